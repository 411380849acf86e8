// The workers' environment: what cohort sets for each process (its place in the job, the store, the
// Ray head, Horovod's variables, an Ascend rank table's), and what the command line hands every worker
// (-x, horovodrun's forwarded environment, OMP_NUM_THREADS).

#include <fmt/core.h>

#include <algorithm>

#include "cohort/error.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/plan_internal.h"

namespace cohort::launch {

// horovodrun's line: the workers on other hosts get this launcher's environment, as horovodrun hands its
// own to each worker it starts over ssh (PATH, PYTHONPATH, the program's settings), with horovodrun's
// exceptions (shell functions, OLDPWD, CUDA_VISIBLE_DEVICES) and cohort's: what the launcher sets for each
// worker (its place in the job), and other launchers' variables (Open MPI's, PMIx's, Slurm's), which
// describe this launcher's process, not the workers. -x still wins: its variables come first.
bool forwarded_to_other_hosts(const std::string& name) {
  static const std::vector<std::string> kOwnNames = {
      "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
      "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "OLDPWD", "HOROVOD_RANK",
      "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE",
      "HOROVOD_HOSTNAME"};
  static const std::vector<std::string> kOwnPrefixes = {"COHORT_", "TORCHELASTIC_", "OMPI_", "PMIX_", "SLURM_",
                                                        "BASH_FUNC_"};
  if (std::find(kOwnNames.begin(), kOwnNames.end(), name) != kOwnNames.end()) return false;
  if (std::any_of(kOwnPrefixes.begin(), kOwnPrefixes.end(), [&](const std::string& x) { return name.starts_with(x); }))
    return false;
  return !name.ends_with("CUDA_VISIBLE_DEVICES");
}

namespace {

void forward_environment(Plan& p, const EnvMap& env) {
  for (const auto& entry : env) {
    // Named references, not a structured binding: clang 14 (the sanitizer build) cannot capture those.
    const std::string& name = entry.first;
    const std::string& value = entry.second;
    if (!forwarded_to_other_hosts(name)) continue;
    if (std::any_of(p.extra_env.begin(), p.extra_env.end(), [&](const auto& kv) { return kv.first == name; })) continue;
    p.extra_env.emplace_back(name, value);
  }
}

// Ray mode: what TI-ONE's Ray mode gives every node (HEAD_ADDR, HEAD_PORT, and RANK: the node's rank, 0 on
// the head), so that a program written for it runs unchanged; and for the driver RAY_ADDRESS, so that
// ray.init() joins this job's cluster and no other cluster running on the same host. Not torchrun's
// variables: the job's processes are Ray's nodes and its driver, not ranks of a communicator (Ray Train
// gives its own workers those).
std::vector<std::pair<std::string, std::string>> ray_process_env(const Plan& plan, const WorkerSlot& s) {
  std::string ip = "<node 0's address, found at start>";
  std::string port = plan.ray.head_port > 0 ? std::to_string(plan.ray.head_port) : "<chosen at start>";
  if (!s.ray_gcs.empty()) {
    auto [host, p] = net::split_host_port(s.ray_gcs);
    ip = host;
    port = std::to_string(p);
  }
  std::vector<std::pair<std::string, std::string>> e;
  e.emplace_back("HEAD_ADDR", plan.ray.head_address.empty() ? ip : plan.ray.head_address);
  e.emplace_back("HEAD_PORT", port);
  e.emplace_back("RANK", std::to_string(s.node_rank));
  if (plan.is_ray_driver(s.rank)) e.emplace_back("RAY_ADDRESS", s.ray_gcs.empty() ? ip + ":" + port : s.ray_gcs);
  for (const auto& kv : plan.extra_env) e.push_back(kv);
  return e;
}

}  // namespace

void set_worker_environment(Plan& p, const Options& o, const EnvMap& env) {
  for (const auto& x : o.export_env) {
    auto eq = x.find('=');
    std::string name = x.substr(0, eq);
    if (name.empty()) throw ConfigError(fmt::format("-x '{}': expected VAR or VAR=value", x));
    if (eq != std::string::npos) {
      p.extra_env.emplace_back(name, x.substr(eq + 1));
    } else {
      auto it = env.find(name);
      if (it == env.end()) throw ConfigError(fmt::format("-x {}: {} is not set in this environment", name, name));
      p.extra_env.emplace_back(name, it->second);
    }
  }
  if (o.forward_environment && std::any_of(p.nodes.begin(), p.nodes.end(), [](const NodePlan& n) { return !n.local; }))
    forward_environment(p, env);
  int max_per_node = 0;
  for (const auto& n : p.nodes) max_per_node = std::max(max_per_node, n.nproc);
  bool omp_given = env.count("OMP_NUM_THREADS") ||
                   std::any_of(p.extra_env.begin(), p.extra_env.end(),
                               [](const auto& kv) { return kv.first == "OMP_NUM_THREADS"; });
  // (Ray sets OMP_NUM_THREADS for its own workers from the CPUs each task asks for.)
  p.set_omp_threads = max_per_node > 1 && !omp_given && !p.ray.enabled;
}

std::vector<std::pair<std::string, std::string>> worker_env(const Plan& plan, const WorkerSlot& s,
                                                            const std::string& store_addr, int torch_port,
                                                            const std::string& token, int restart_count,
                                                            const EnvMap& launcher_env) {
  if (plan.ray.enabled) return ray_process_env(plan, s);
  std::vector<std::pair<std::string, std::string>> e;
  auto set = [&](const char* k, const std::string& v) { e.emplace_back(k, v); };
  // Host part of "host:port" / "[v6]:port" (the port may still be a placeholder in --dry-run).
  std::string store_host = store_addr.substr(0, store_addr.rfind(':'));
  if (store_host.size() > 2 && store_host.front() == '[') store_host = store_host.substr(1, store_host.size() - 2);
  // In a parameter-server job RANK/WORLD_SIZE/LOCAL_* count the process's own role (the workers'
  // data-parallel group is the workers), and COHORT_ROLE* say which role (docs/parameter-server.md).
  int rank = s.rank, world = plan.world_size, local_rank = s.local_rank, local_world = s.local_world;
  if (plan.ps_servers > 0) {
    ProcessRole role = plan.role_of(s.rank);
    rank = role.index;
    world = role.server ? plan.ps_servers : plan.num_workers;
    local_rank = role.local_index;
    local_world = role.local_count;
  }
  set("RANK", std::to_string(rank));
  set("LOCAL_RANK", std::to_string(local_rank));
  set("WORLD_SIZE", std::to_string(world));
  set("LOCAL_WORLD_SIZE", std::to_string(local_world));
  set("GROUP_RANK", std::to_string(s.node_rank));
  set("GROUP_WORLD_SIZE", std::to_string(plan.nnodes));
  set("ROLE_RANK", std::to_string(rank));
  set("ROLE_WORLD_SIZE", std::to_string(world));
  set("ROLE_NAME", plan.ps_servers > 0 ? (plan.role_of(s.rank).server ? "server" : "worker") : "default");
  set("NODE_RANK", std::to_string(s.node_rank));
  set("MASTER_ADDR", store_host);
  // torch's env:// makes rank 0 host its own TCPStore at MASTER_PORT: a port distinct from cohort's
  // store, chosen free on the store host (see docs/launcher.md).
  set("MASTER_PORT", torch_port > 0 ? std::to_string(torch_port) : "<chosen at start>");
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(plan.max_restarts));
  set("TORCHELASTIC_RUN_ID", plan.job_id);
  set("COHORT_STORE_ADDR", store_addr);
  set("COHORT_JOB_ID", plan.job_id);
  set("COHORT_JOB_TOKEN", token);
  set("COHORT_RANK", std::to_string(rank));
  set("COHORT_WORLD_SIZE", std::to_string(world));
  set("COHORT_LOCAL_RANK", std::to_string(local_rank));
  set("COHORT_LOCAL_WORLD_SIZE", std::to_string(local_world));
  if (plan.horovod_env) {
    // As `horovodrun --gloo` sets them (Horovod's runner, slot by slot): the cross ranks of local rank l
    // are the nodes that have an l-th worker, numbered in node order; with equal nodes, the node rank and
    // the node count. Programs that read them (and Horovod's own probes) see the job as Horovod's.
    int cross_rank = 0, cross_size = 0;
    for (const auto& node : plan.nodes) {
      if (node.nproc - node.nservers <= local_rank) continue;
      if (node.node_rank < s.node_rank) ++cross_rank;
      ++cross_size;
    }
    if (plan.elastic || cross_size == 0) {  // an elastic plan lists this node only: its nodes are equal
      cross_rank = s.node_rank;
      cross_size = plan.nnodes;
    }
    const NodePlan* node = plan.node_of_process(s.rank);
    set("HOROVOD_RANK", std::to_string(rank));
    set("HOROVOD_SIZE", std::to_string(world));
    set("HOROVOD_LOCAL_RANK", std::to_string(local_rank));
    set("HOROVOD_LOCAL_SIZE", std::to_string(local_world));
    set("HOROVOD_CROSS_RANK", std::to_string(cross_rank));
    set("HOROVOD_CROSS_SIZE", std::to_string(cross_size));
    set("HOROVOD_HOSTNAME", node ? node->host : std::string("localhost"));
  }
  if (!plan.rank_table_slots.empty() && size_t(s.rank) < plan.rank_table_slots.size()) {
    // As the Ascend launch scripts set them for each process of a rank table.
    set("DEVICE_ID", std::to_string(plan.rank_table_slots[size_t(s.rank)].first));
    set("RANK_ID", std::to_string(plan.rank_table_slots[size_t(s.rank)].second));
    set("RANK_SIZE", std::to_string(plan.rank_table_size));
  }
  if (plan.ps_servers > 0) {
    set("COHORT_ROLE", plan.role_of(s.rank).server ? "server" : "worker");
    set("COHORT_ROLE_INDEX", std::to_string(rank));
    set("COHORT_NUM_SERVERS", std::to_string(plan.ps_servers));
    set("COHORT_NUM_WORKERS", std::to_string(plan.num_workers));
    set("COHORT_PS_MODE", plan.ps_mode);
  }
  if (launcher_env.count("SLURM_JOB_ID")) {
    // Under Slurm a worker inherits the launcher's (or its srun step's) task variables: SLURM_PROCID=0
    // and SLURM_NTASKS=1 in every worker of an agent. Programs that take their rank from Slurm
    // (Lightning's SLURMEnvironment, submitit, many sbatch-era scripts) would then all be rank 0 of 1:
    // they get the worker's own place instead, as if srun had started each rank.
    set("SLURM_PROCID", std::to_string(rank));
    set("SLURM_LOCALID", std::to_string(local_rank));
    set("SLURM_NODEID", std::to_string(s.node_rank));
    set("SLURM_NTASKS", std::to_string(world));
    set("SLURM_NPROCS", std::to_string(world));
  }
  set("COHORT_NODE_RANK", std::to_string(s.node_rank));
  set("COHORT_NNODES", std::to_string(plan.nnodes));
  set("COHORT_RESTART_COUNT", std::to_string(restart_count));
  if (plan.set_omp_threads) set("OMP_NUM_THREADS", "1");
  if (s.gpu.device >= 0) {
    // torchrun's contract: CUDA_VISIBLE_DEVICES whole, the program picks device LOCAL_RANK. With
    // --gpu-share two ranks map to one device, so the device to use is named explicitly too.
    set("COHORT_GPUS_PER_NODE", std::to_string(plan.gpus_per_node > 0 ? plan.gpus_per_node : 0));
    if (plan.device_per_rank) {
      set("CUDA_VISIBLE_DEVICES", s.gpu.visible_id);
      set("COHORT_LOCAL_GPU", "0");
    } else {
      set("COHORT_LOCAL_GPU", std::to_string(s.gpu.device));
    }
  } else if (plan.device_per_rank) {
    auto ascend_var = launcher_env.find("ASCEND_RT_VISIBLE_DEVICES");
    bool ascend = (ascend_var != launcher_env.end() && !ascend_var->second.empty()) || access("/dev/davinci0", F_OK) == 0;
    const char* var = ascend ? "ASCEND_RT_VISIBLE_DEVICES" : "CUDA_VISIBLE_DEVICES";
    // When the launcher itself sees a subset of devices, rank i gets the i-th of that subset.
    std::string device = std::to_string(s.local_rank);
    if (auto it = launcher_env.find(var); it != launcher_env.end() && !it->second.empty()) {
      auto visible = str::split(it->second, ',');
      if (!visible.empty()) device = visible[static_cast<size_t>(s.local_rank) % visible.size()];
    }
    set(var, device);
  }
  for (const auto& kv : plan.extra_env) e.push_back(kv);
  return e;
}

}  // namespace cohort::launch
