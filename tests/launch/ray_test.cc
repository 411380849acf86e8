// Unit tests of Ray mode's pure parts (launch/ray.h): the `ray start` and `ray status` commands, the ports
// of a node, and the reading of `ray status` in the formats Ray's versions print.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "cohort/error.h"
#include "launch/ray.h"
#include "launch_test_util.h"

namespace cohort::launch {
namespace {

// `ray status` of Ray 2.x with the first autoscaler, for a cluster started by hand (`ray start`), as
// ray/autoscaler/_private/util.py's format_info_string prints it: every node is a node type of its own.
const char* kRayStatusActive = R"(======== Autoscaler status: 2024-05-21 09:14:07.151022 ========
Node status
---------------------------------------------------------------
Active:
 1 node_5d3c6f1a0b7e4c2d8f9a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2
 1 node_0f1e2d3c4b5a69788796a5b4c3d2e1f00112233445566778899aabbc
 1 node_a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a
Pending:
 (no pending nodes)
Recent failures:
 (no failures)

Resources
---------------------------------------------------------------
Usage:
 0.0/24.0 CPU
 0.0/2.0 GPU
 0.0/1.0 Rank:0
 0.0/1.0 Rank:1
 0.001/1.0 Rank:2
 0B/58.61GiB memory
 0B/25.12GiB object_store_memory

Demands:
 (no resource demands)
)";

// Later 2.x versions say "Healthy:"; the v2 autoscaler splits the alive nodes into "Active:" and "Idle:".
const char* kRayStatusIdle = R"(======== Autoscaler status: 2025-01-08 17:02:44.870362 ========
Node status
---------------------------------------------------------------
Active:
 (no active nodes)
Idle:
 1 node_5d3c6f1a0b7e4c2d8f9a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2
 1 node_0f1e2d3c4b5a69788796a5b4c3d2e1f00112233445566778899aabbc
Pending:
 (no pending nodes)
Recent failures:
 node_a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a: NodeTerminated (ip: 10.0.0.3)

Resources
---------------------------------------------------------------
Total Usage:
 0.0/16.0 CPU
 0.0/1.0 Rank:0
 0.0/1.0 Rank:1
 0B/39.07GiB memory
 0B/16.74GiB object_store_memory

Total Demands:
 (no resource demands)
)";

TEST(Ray, RankResourceIsTioneStyle) {
  EXPECT_EQ(ray_rank_resource(0), "Rank:0");
  EXPECT_EQ(ray_rank_resource(12), "Rank:12");
}

TEST(Ray, StatusOfEachRayVersionGivesTheNodesAndTheirRanks) {
  auto active = parse_ray_status(kRayStatusActive);
  EXPECT_TRUE(active.understood);
  EXPECT_EQ(active.nodes, 3);
  EXPECT_EQ(active.ranks, (std::set<int>{0, 1, 2}));

  // A dead node is under "Recent failures" and its resources left the usage: neither counts.
  auto idle = parse_ray_status(kRayStatusIdle);
  EXPECT_TRUE(idle.understood);
  EXPECT_EQ(idle.nodes, 2);
  EXPECT_EQ(idle.ranks, (std::set<int>{0, 1}));

  std::string healthy = kRayStatusActive;
  healthy.replace(healthy.find("Active:"), 7, "Healthy:");
  EXPECT_EQ(parse_ray_status(healthy).nodes, 3);

  // A resource with a total of 0, a name that only starts like a rank, or a line of another section is no rank.
  auto odd = parse_ray_status("Node status\n---\nActive:\n 1 node_x\nPending:\n 1 node_y\n\nResources\n---\nUsage:\n"
                              " 0.0/0.0 Rank:5\n 0.0/1.0 Rank:x\n 0.0/1.0 Rankings:1\n 0.0/1.0 Rank:4\nDemands:\n"
                              " {'Rank:7': 1.0}: 1+ pending tasks/actors\n");
  EXPECT_EQ(odd.nodes, 1);
  EXPECT_EQ(odd.ranks, (std::set<int>{4}));

  // What `ray status` prints before the cluster has reported anything, or when the GCS is not there.
  EXPECT_FALSE(parse_ray_status("No cluster status. It may take a few seconds for the Ray internal services to start "
                                "up.\n")
                   .understood);
  auto refused = parse_ray_status("ConnectionError: Could not find any running Ray instance.\n");
  EXPECT_FALSE(refused.understood);
  EXPECT_EQ(refused.nodes, 0);
  EXPECT_TRUE(refused.ranks.empty());
  // Windows line ends.
  std::string crlf;
  for (char c : std::string(kRayStatusActive)) crlf += c == '\n' ? std::string("\r\n") : std::string(1, c);
  EXPECT_EQ(parse_ray_status(crlf).ranks.size(), 3u);
}

TEST(Ray, StartOfTheHeadAndOfAWorkerNode) {
  RayStart head;
  head.head = true;
  head.port = 6379;
  head.node_ip = "10.0.0.1";
  head.node_rank = 0;
  head.num_cpus = 16;
  head.num_gpus = 2;
  head.ports = ray_ports_in(23000, 23999);
  EXPECT_EQ(ray_start_argv("/opt/venv/bin/ray", head),
            (std::vector<std::string>{"/opt/venv/bin/ray", "start", "--head", "--port", "6379", "--node-ip-address",
                                      "10.0.0.1", "--num-cpus", "16", "--num-gpus", "2", "--resources",
                                      R"({"Rank:0": 1})", "--node-manager-port", "23000", "--object-manager-port",
                                      "23001", "--dashboard-agent-listen-port", "23002", "--dashboard-agent-grpc-port",
                                      "23003", "--metrics-export-port", "23004", "--runtime-env-agent-port", "23005",
                                      "--min-worker-port", "23007", "--max-worker-port", "23999",
                                      "--ray-client-server-port", "23006", "--include-dashboard", "false",
                                      "--disable-usage-stats", "--block"}));
  RayStart worker = head;
  worker.head = false;
  worker.gcs = "10.0.0.1:6379";
  worker.node_ip = "10.0.0.2";
  worker.node_rank = 3;
  auto argv = ray_start_argv("ray", worker);
  // Ray refuses --port and --include-dashboard without --head; the client server runs on the head only.
  for (const char* head_only : {"--head", "--port", "--include-dashboard", "--ray-client-server-port"})
    EXPECT_EQ(std::find(argv.begin(), argv.end(), head_only), argv.end()) << head_only;
  EXPECT_EQ(argv[2], "--address");
  EXPECT_EQ(argv[3], "10.0.0.1:6379");
  EXPECT_NE(std::find(argv.begin(), argv.end(), R"({"Rank:3": 1})"), argv.end());
  EXPECT_EQ(argv.back(), "--block");
  EXPECT_EQ(ray_status_argv("ray", "10.0.0.1:6379"),
            (std::vector<std::string>{"ray", "status", "--address", "10.0.0.1:6379"}));
  EXPECT_EQ(ray_address("10.0.0.1", 6379), "10.0.0.1:6379");
  EXPECT_EQ(ray_address("fd00::1", 6379), "[fd00::1]:6379");
}

// The fake port table of one host: which ports are taken.
std::set<int>& taken_ports() {
  static std::set<int> taken;
  return taken;
}
bool fake_port_free(int port) { return !taken_ports().count(port); }

TEST(Ray, PortsComeFromTheJobsBlockOrTheNextFreeOne) {
  taken_ports().clear();
  const int block = ray_default_block("job-h0-29500");
  EXPECT_EQ(block, ray_default_block("job-h0-29500"));  // every node of the job computes the same
  EXPECT_GE(block, 0);
  EXPECT_LT(block, kRayPortBlocks);
  std::set<int> blocks;
  for (int j = 0; j < 40; ++j) blocks.insert(ray_default_block("job-" + std::to_string(j)));
  EXPECT_GT(blocks.size(), 6u) << "jobs should spread over the blocks";
  auto [lo, hi] = ray_block_range(block);
  EXPECT_EQ(hi - lo + 1, kRayPortBlock);
  EXPECT_GE(lo, kRayPortsBase);
  EXPECT_LT(hi, 32768) << "below Linux's ephemeral ports";

  auto mine = pick_ray_ports(0, 0, "job-h0-29500", 0, "h0", &fake_port_free);
  EXPECT_EQ(mine.node_manager, lo);
  EXPECT_EQ(mine.client_server, lo + kRaySinglePorts - 1);
  EXPECT_EQ(mine.min_worker, lo + kRaySinglePorts);
  EXPECT_EQ(mine.max_worker, hi);

  // Another job's Ray holds a port of the block here: the next block.
  taken_ports().insert(lo + 500);
  auto moved = pick_ray_ports(0, 0, "job-h0-29500", 0, "h0", &fake_port_free);
  EXPECT_EQ(moved.node_manager, ray_block_range((block + 1) % kRayPortBlocks).first);
  // So does the head's GCS port when it falls in the block.
  taken_ports().clear();
  EXPECT_NE(pick_ray_ports(0, 0, "job-h0-29500", lo + 3, "h0", &fake_port_free).node_manager, lo);

  // A range given is kept, or refused naming the port in use.
  EXPECT_EQ(pick_ray_ports(40000, 40015, "j", 0, "h2", &fake_port_free).max_worker, 40015);
  taken_ports().insert(40004);
  EXPECT_EQ(error_of([] { pick_ray_ports(40000, 40015, "j", 0, "h2", &fake_port_free); }),
            "--ray-ports 40000-40015: port 40004 is in use on h2; choose a range that is free on every node, or leave "
            "--ray-ports out");
  taken_ports().clear();
  EXPECT_NE(error_of([] { pick_ray_ports(40000, 40015, "j", 40002, "h2", &fake_port_free); })
                .find("port 40002 is in use on h2 (it is the Ray head's GCS port)"),
            std::string::npos);

  // Every block has a port taken: one line naming them and the way out.
  for (int b = 0; b < kRayPortBlocks; ++b) taken_ports().insert(ray_block_range(b).first + 9);
  auto why = error_of([] { pick_ray_ports(0, 0, "j", 0, "h1", &fake_port_free); });
  EXPECT_NE(why.find("no free block of 1000 ports for Ray on h1 in 20000-31999"), std::string::npos) << why;
  EXPECT_NE(why.find("20000-20999: 20009"), std::string::npos) << why;
  EXPECT_NE(why.find("give --ray-ports FIRST-LAST"), std::string::npos) << why;
  taken_ports().clear();
}

}  // namespace
}  // namespace cohort::launch
