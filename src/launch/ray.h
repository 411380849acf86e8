#pragma once
// Ray mode (`cohort run --ray`, docs/ray.md): what a node runs to bring a Ray cluster up on the job's
// nodes, and how cohort reads Ray's own account of the cluster. Pure functions of their inputs, so each is
// unit-tested with plain strings; the job's side (starting them, waiting, the driver, teardown) is
// launch/job_ray.cc.
//
// The contract is Ray's documented command line (Ray's CLI reference, python/ray/scripts/scripts.py):
// `ray start --head|--address ... --block`, `ray status --address HOST:PORT`, Ray 2.7.1 or newer (the first
// with --runtime-env-agent-port, without which one of a node's ports cannot be chosen).

#include <set>
#include <string>
#include <utility>
#include <vector>

namespace cohort::launch {

// The custom resource that names node `node_rank` in the Ray cluster: a task or actor declared with
// resources={"Rank:1": 0.001} runs on node 1 (the convention of TI-ONE's Ray mode). Each node has 1 of it.
std::string ray_rank_resource(int node_rank);

// A node's Ray ports besides the head's GCS port, all from one range so that two jobs on one host never
// share one (Ray's defaults are fixed: 10001 for the client server, 52365 for the dashboard agent,
// 10002-19999 for the worker processes): the single ports first, then the worker processes' range, one
// port per Ray worker process.
struct RayPorts {
  int node_manager = 0;
  int object_manager = 0;
  int dashboard_agent_listen = 0;
  int dashboard_agent_grpc = 0;
  int metrics_export = 0;
  int runtime_env_agent = 0;
  int client_server = 0;  // the head's Ray client server
  int min_worker = 0;
  int max_worker = 0;
};
inline constexpr int kRaySinglePorts = 7;
inline constexpr int kRayMinPortRange = 16;  // the single ports and at least 9 worker processes
// The ports of the range [first, last] (at least kRayMinPortRange of them).
RayPorts ray_ports_in(int first, int last);

// The default ranges: kRayPortBlocks blocks of kRayPortBlock ports from kRayPortsBase, below Linux's
// ephemeral ports (32768 on: an outgoing connection may hold any of those at any time) and above Ray's own
// defaults. A job starts at the block its id hashes to, so that two jobs on one host most likely differ.
inline constexpr int kRayPortsBase = 20000;
inline constexpr int kRayPortBlock = 1000;
inline constexpr int kRayPortBlocks = 12;
int ray_default_block(const std::string& job_id);
std::pair<int, int> ray_block_range(int block);

// This node's Ray ports: the range given (--ray-ports FIRST-LAST; `first` 0: none given) when every port
// of it is free here, else the job's default block, or the next one while one of its ports is taken here
// (another job's Ray, most likely). `avoid`: a port that is not free although nothing holds it yet (the
// head's GCS port). `port_free` tells whether this host can bind a port (a test passes a fake). Throws
// ConfigError naming the range, the port in use and `host`.
RayPorts pick_ray_ports(int first, int last, const std::string& job_id, int avoid, const std::string& host,
                        bool (*port_free)(int));

// What `ray start` is given on one node.
struct RayStart {
  bool head = false;
  int port = 0;             // the head's GCS port (--port)
  std::string gcs;          // the others: the head's GCS, HOST:PORT (--address)
  std::string node_ip;      // --node-ip-address: this node's address that the other nodes reach
  int node_rank = 0;        // its Rank:<n> resource
  int num_cpus = 1;
  int num_gpus = 0;
  RayPorts ports;
};
// `ray start ... --block`: the command stays in the foreground as long as the node's Ray processes run, so
// that cohort supervises it like any process of the job (Ray's own --block reports a Ray process that
// dies by exiting 1, and stops them all on SIGTERM). No dashboard (it needs ray[default] and a port of its
// own), no usage statistics sent from the job's nodes.
std::vector<std::string> ray_start_argv(const std::string& ray, const RayStart& s);
std::vector<std::string> ray_status_argv(const std::string& ray, const std::string& gcs);

// What `ray status` says: the nodes Ray counts as alive (the node lines under "Active:", "Healthy:" or
// "Idle:", which Ray's versions use in turn) and the Rank:<n> resources the cluster's "Usage:" lists (a
// dead node's resources leave it). `understood`: the text has Ray's "Node status" section.
struct RayStatus {
  bool understood = false;
  int nodes = 0;
  std::set<int> ranks;
};
RayStatus parse_ray_status(const std::string& text);

// "HOST:PORT" of Ray's GCS ("[v6]:PORT" for an IPv6 address).
std::string ray_address(const std::string& ip, int port);

}  // namespace cohort::launch
