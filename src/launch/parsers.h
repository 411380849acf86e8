#pragma once
// Pure parsers for the launcher's inputs: hostfiles, -H lists, Slurm node lists, TF_CONFIG and the
// node-level variables that schedulers and training platforms inject. None of them touches the
// process environment or the file system (the caller reads files and passes an EnvMap), so each is
// unit-tested with plain strings. Every error is a ConfigError naming the input and what is wrong.

#include <map>
#include <optional>
#include <string>
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
  std::optional<Sourced<int>> node_rank;
  std::optional<Sourced<int>> nproc_per_node;
  std::optional<Sourced<std::string>> master_addr;
  std::optional<Sourced<int>> master_port;
  std::optional<Sourced<std::string>> job_id;
  std::optional<Sourced<int>> ps_nodes;  // TF_CONFIG's cluster.ps: the last N nodes run one server each
  std::vector<std::string> scheduler_names;  // "Slurm", "Open MPI", ... (for the plan printout)
};
SchedulerInfo read_scheduler_env(const EnvMap& env);

// "3" -> 3, with a ConfigError "<what>=<text>: expected an integer >= min" otherwise.
int parse_int_at_least(const std::string& text, const std::string& what, int min);

}  // namespace cohort::launch
