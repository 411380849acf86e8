#pragma once
// Pure parsers for the launcher's inputs: hostfiles, -H lists, Slurm node lists, TF_CONFIG and the
// node-level variables that schedulers and training platforms inject. None of them touches the
// process environment or the file system (the caller reads files and passes an EnvMap), so each is
// unit-tested with plain strings. Every error is a ConfigError naming the input and what is wrong.

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cohort::launch {

using EnvMap = std::map<std::string, std::string>;

struct HostSlots {
  std::string host;
  int slots = 1;
  int max_slots = 0;  // 0 = not given
  bool operator==(const HostSlots&) const = default;
};

// Open MPI / DeepSpeed hostfile: "host [slots=N] [max_slots=M]" (also "slots:N"), '#' comments,
// blank lines; a repeated host adds its slots to the first entry. `origin` names the file in errors
// ("hosts.txt:3: slots=0: expected a positive number").
std::vector<HostSlots> parse_hostfile(const std::string& text, const std::string& origin);

// mpirun -H: "a:8,b:8,c" (no count = 1 slot); a repeated host adds slots.
std::vector<HostSlots> parse_host_list(const std::string& text, const std::string& origin = "-H");

// Slurm compressed node list: "node[01-04,07],gpu7,rack[1-2]-n[1-2]" -> every host name, in order,
// zero padding kept.
std::vector<std::string> expand_slurm_nodelist(const std::string& text);

// Slurm "2(x3),1" counts (SLURM_TASKS_PER_NODE, SLURM_JOB_CPUS_PER_NODE) -> {2,2,2,1}.
std::vector<int> expand_slurm_counts(const std::string& text, const std::string& what);

// Ascend HCCL rank table (RANK_TABLE_FILE), both layouts:
//   1.0: {"version": "1.0", "server_count": "2", "server_list": [{"server_id": "10.0.0.1",
//         "device": [{"device_id": "0", "device_ip": "192.168.100.1", "rank_id": "0"}, ...]}, ...]}
//   0.x: {"group_count": "1", "group_list": [{"instance_count": "16", "instance_list":
//         [{"server_id": "10.0.0.1", "rank_id": "0", "devices": [{"device_id": "0", "device_ip": ...}]}, ...]}]}
// Numbers may be strings or numbers. Checked: server_count agrees with the list, every server has
// devices, rank ids are 0..N-1 once each, device ids are unique per server. Errors name the file and
// the field ("RANK_TABLE_FILE t.json: server_list[1].device[0].rank_id: 3 appears twice").
struct RankTableDevice {
  int device_id = 0;
  std::string device_ip;
  int rank_id = 0;
};
struct RankTableServer {
  std::string server_id;  // the host's address (how a node finds itself)
  std::vector<RankTableDevice> devices;
};
struct RankTable {
  std::string layout;  // "1.0" or "0.x"
  std::vector<RankTableServer> servers;
  int rank_size = 0;
};
RankTable parse_rank_table(const std::string& json, const std::string& origin);
// The server whose server_id is one of `addresses` (this host's names and addresses), or -1.
int rank_table_node(const RankTable& table, const std::vector<std::string>& addresses);

// TF_CONFIG (worker role): nodes are cluster.chief then cluster.worker; this node is task.index
// within its type.
struct TfConfig {
  std::vector<std::string> nodes;  // "host:port" each: chief/master, workers, then ps entries
  int node_rank = 0;
  int ps_nodes = 0;  // the last ps_nodes entries are parameter servers (cluster.ps)
};
TfConfig parse_tf_config(const std::string& json);

// One value a scheduler environment supplies, with where it came from ("SLURM_NNODES").
template <typename T>
struct Sourced {
  T value{};
  std::string source;
};

// What the scheduler / platform variables say about the node layout. Each field is set when at
// least one source gives it; two sources that disagree throw ConfigError naming both.
struct SchedulerInfo {
  std::optional<Sourced<int>> nnodes;
  // PET_NNODES=MIN:MAX with MIN < MAX (Kubeflow's elastic PyTorchJob): the minimum; nnodes is the maximum.
  std::optional<Sourced<int>> min_nodes;
  std::optional<Sourced<int>> node_rank;
  std::optional<Sourced<int>> nproc_per_node;
  std::optional<Sourced<std::string>> master_addr;
  std::optional<Sourced<int>> master_port;
  // A port to use when nothing names one (an srun step: derived from the job and step ids, so that
  // every node picks the same one without talking and two jobs on one node pick different ones).
  std::optional<Sourced<int>> default_master_port;
  std::optional<Sourced<std::string>> job_id;
  std::optional<Sourced<int>> ps_nodes;  // TF_CONFIG's cluster.ps: the last N nodes run one server each
  // TI-ONE's Ray mode: HEAD_ADDR (the Ray head, node 0: RANK=0) and HEAD_PORT (its GCS port). Used by
  // `cohort run --ray` only (docs/ray.md); the node rank is RANK's, read as torchrun's above.
  std::optional<Sourced<std::string>> ray_head_addr;
  std::optional<Sourced<int>> ray_head_port;
  std::optional<RankTable> rank_table;   // RANK_TABLE_FILE (read and checked)
  std::vector<std::string> scheduler_names;  // "Slurm", "Open MPI", ... (for the plan printout)
};
// `addresses`: this host's names and IP addresses (a rank table's node is the server listing one).
SchedulerInfo read_scheduler_env(const EnvMap& env, const std::vector<std::string>& addresses = {});

// A Slurm allocation as a batch script or an salloc shell sees it (SLURM_JOB_ID and SLURM_JOB_NODELIST
// set, SLURM_STEP_ID not: not inside an srun step). `cohort run` there starts one agent per node through
// srun (docs/slurm.md). Slots per node: SLURM_TASKS_PER_NODE, or SLURM_GPUS_PER_NODE for a GPU
// allocation without a task count. std::nullopt outside such an allocation.
struct SlurmAllocation {
  std::string job_id;
  std::vector<HostSlots> nodes;  // SLURM_JOB_NODELIST, in order, with their slots
  std::string slots_source;
  std::string this_node;  // SLURMD_NODENAME: the batch host; "" in an salloc shell on a login node
};
std::optional<SlurmAllocation> read_slurm_allocation(const EnvMap& env);
// The store port of a job that srun starts once per node: 20000 + (job % 1000) * 10 + step % 10.
int slurm_store_port(const std::string& job_id, const std::string& step_id);

// "3" -> 3, with a ConfigError "<what>=<text>: expected an integer >= min" otherwise.
int parse_int_at_least(const std::string& text, const std::string& what, int min);

// The rank that a line of a failed worker's stderr reports gone, if it reports one (Job's summary
// then says whether that rank had exited cleanly). In the communicator's words, when it read the
// launcher's exit record (comm/peer_exits.h): "rank 1 exited (code 0)", "rank 1 (job rank 5) exited
// (code 0)" (the job rank counts); else in the transports': "shm: rank 1 (host) (pid 9) exited during
// allreduce", "lost rank 1 (host): ...", "rank 1 (host) left ...". The first two forms are looked
// for in the whole line before the others.
std::optional<int> rank_reported_gone(std::string_view line);

}  // namespace cohort::launch
