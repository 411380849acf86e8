// Placement by one launcher per node (torchrun's way): each node's `cohort run` places itself from its
// flags and, where they leave it open, the scheduler's environment (an srun step, Kubeflow's PET_*,
// TI-ONE's, Open MPI's, a rank table, TF_CONFIG). torchrun's multi-node line and --nnodes MIN:MAX meet
// at an elastic rendezvous instead of fixed node ranks; a job of one node is a local job.

#include <fmt/core.h>

#include <algorithm>

#include "cohort/error.h"
#include "common/env.h"
#include "common/strings.h"
#include "launch/plan_internal.h"

namespace cohort::launch {
namespace {
// Read from the launcher's environment as the plan sees it (an injected map in tests).
const env::SecondsSetting kAgentLease("COHORT_AGENT_LEASE_S", 3.0,
                                      "elastic jobs: each node's agent holds a lease in the store, renewed several "
                                      "times within this time; its end tells the others that the node is gone");

// torchrun's multi-node line (`--nnodes N --rdzv-backend c10d --rdzv-endpoint H:P`, the same on every
// node, no --node-rank): torchrun assigns node ranks at the rendezvous. So does cohort, through the
// elastic rendezvous with MIN = MAX = N. A node rank from a flag or a scheduler, `--rdzv-backend
// static` (torchrun's static rendezvous needs --node-rank), Ray and parameter-server jobs keep the
// fixed layout.
bool ranks_at_rendezvous(const Options& o, const SchedulerInfo& sched) {
  if (!o.nnodes || *o.nnodes < 2 || o.min_nodes || o.node_rank || sched.node_rank) return false;
  if (o.rdzv_backend == "static" || o.ray || o.ps) return false;
  return o.rdzv_endpoint || o.rdzv_backend == "c10d";
}

// --nnodes MIN:MAX (or Kubeflow's PET_NNODES=MIN:MAX): torchrun's elastic job (the agents meet in
// generations, launch/rendezvous.h).
void set_elastic(Plan& p, const Options& o, const EnvMap& env, int min_nodes, int max_nodes,
                 const std::string& source) {
  p.elastic = true;
  p.min_nodes = min_nodes;
  p.max_nodes = max_nodes;
  if (p.min_nodes < 1 || p.max_nodes < p.min_nodes)
    throw ConfigError(fmt::format("--nnodes {}:{}: expected 1 <= MIN <= MAX", p.min_nodes, p.max_nodes));
  if (o.rdzv_backend && *o.rdzv_backend != "c10d")
    throw ConfigError(fmt::format("--rdzv-backend {}: an elastic job (--nnodes MIN:MAX) meets in cohort's own store; "
                                  "use c10d (the default) or leave the flag out",
                                  *o.rdzv_backend));
  if (o.rdzv_last_call_s < 0)
    throw ConfigError(fmt::format("--rdzv-conf last_call_timeout={:g}: expected seconds >= 0", o.rdzv_last_call_s));
  p.rdzv_last_call_s = o.rdzv_last_call_s;
  if (auto it = env.find(kAgentLease.name()); it != env.end() && !it->second.empty()) {
    p.agent_lease_s = kAgentLease.from(it->second);
    if (p.agent_lease_s < 0.2 || p.agent_lease_s > 3600)
      throw ConfigError(fmt::format("COHORT_AGENT_LEASE_S={}: expected 0.2 to 3600 seconds", it->second));
  }
  p.sources.emplace_back("elastic", source);
}

// The variables a shell keeps after a DDP script was run by hand (`export MASTER_ADDR=... RANK=0
// WORLD_SIZE=2`), which torchrun and Kubeflow's first operators also use to place a job of nodes.
constexpr const char* kShellLeftovers[] = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"};

// The scheduler environment that places a per-node or local job. `local_shape`: the command line gives
// this node's processes (-n, --nproc-per-node, -N, --map-by ppr:N:node) and no node count or node rank.
// Such a command is a job on this machine, as torchrun makes it: MASTER_ADDR, MASTER_PORT, WORLD_SIZE and
// RANK alone are then a shell's leftovers, ignored with one note naming them (a job of several nodes
// waiting 300 s for a node that never comes is what they would make). With any platform's own variables
// beside them (Slurm's, Kubeflow's PET_*, TI-ONE's NODE_LIST, Open MPI's, a rank table, TF_CONFIG,
// HEAD_ADDR) the environment is a platform's and places the job as it always did.
SchedulerInfo placement_env(const EnvMap& env, bool local_shape, const std::string& shape,
                            const MachineFacts& machine, std::vector<std::string>& notes) {
  if (!local_shape) return read_scheduler_env(env, machine.addresses);
  EnvMap rest = env;
  std::vector<std::string> ignored;
  for (const char* name : kShellLeftovers) {
    auto it = rest.find(name);
    if (it == rest.end()) continue;
    if (!it->second.empty()) ignored.push_back(fmt::format("{}={}", name, it->second));
    rest.erase(it);
  }
  SchedulerInfo platform = read_scheduler_env(rest, machine.addresses);
  if (ignored.empty() || !platform.scheduler_names.empty()) return read_scheduler_env(env, machine.addresses);
  notes.push_back(fmt::format(
      "ignoring {} from the environment: {} without --nnodes is a job on this machine (as with torchrun), and no "
      "platform's variables (Slurm's, Kubeflow's PET_*, TI-ONE's NODE_LIST, ...) came with them; for a job of "
      "several nodes give --nnodes and --node-rank",
      str::join(ignored, " "), shape));
  return platform;
}

}  // namespace

void place_per_node(Plan& p, const Options& o, const EnvMap& env, const Shape& flags, const MachineFacts& machine,
                    PlacementFinds& found) {
  auto source = [&](const std::string& setting, const std::string& from) { p.sources.emplace_back(setting, from); };
  const std::optional<int>& nproc_flag = flags.nproc_flag;
  const std::string& nproc_flag_name = flags.nproc_flag_name;
  const std::string& nproc_how = flags.nproc_how;
  const std::optional<int>& gpus_here = flags.gpus_here;
  std::optional<Sourced<std::string>>& sched_job_id = found.sched_job_id;
  std::optional<Sourced<int>>& sched_ps_nodes = found.sched_ps_nodes;
  std::optional<Sourced<std::string>>& ray_head_address = found.ray_head_address;
  std::optional<Sourced<int>>& ray_head_port = found.ray_head_port;
  // Per-node (torchrun style) or local. The scheduler environment fills what flags leave open.
  SchedulerInfo sched;
  // With --nnodes the flags say the layout; in an srun step Slurm still says where node 0 is, which
  // node this is and which port the job's nodes agree on.
  const bool in_srun_step = env.count("SLURM_STEP_ID") && env.count("SLURM_STEP_NODELIST");
  // TI-ONE's Ray mode names the head and this node's rank but not the node count: --nnodes gives it,
  // and the platform's variables still say the rest.
  const bool ray_platform = o.ray && env.count("HEAD_ADDR") && !env.at("HEAD_ADDR").empty();
  const bool local_shape = (o.np || nproc_flag) && !o.nnodes && !o.node_rank;
  // The flag that gave the shape, as typed (for the note): "-n 2", "--nproc-per-node 2", "--map-by ppr:2:node".
  const std::string shape = !nproc_flag           ? fmt::format("-n {}", o.np.value_or(0))
                            : o.map_by && !o.nproc_per_node ? nproc_flag_name
                                                  : nproc_flag_name + " " + o.nproc_per_node.value_or("");
  if (!o.nnodes || in_srun_step || ray_platform) sched = placement_env(env, local_shape, shape, machine, p.notes);
  ray_head_address = sched.ray_head_addr;
  ray_head_port = sched.ray_head_port;
  // Without a count (the platform gives none) the head cannot wait for "every node": it starts the driver
  // once its own Ray is up, and the others join it whenever they start (docs/ray.md). This node knows of
  // the head and of itself: nodes 0..RANK, of which it waits for node 0 only.
  const bool ray_uncounted = ray_platform && !o.nnodes && !sched.nnodes;
  p.ray.open_membership = ray_uncounted;
  p.schedulers = sched.scheduler_names;
  sched_job_id = sched.job_id;
  sched_ps_nodes = sched.ps_nodes;
  const int known_nodes = ray_uncounted && sched.node_rank ? sched.node_rank->value + 1 : 1;
  p.nnodes = o.nnodes ? *o.nnodes : sched.nnodes ? sched.nnodes->value : known_nodes;
  source("nnodes", o.nnodes ? (o.min_nodes ? "--nnodes MIN:MAX" : "--nnodes")
                   : sched.nnodes ? sched.nnodes->source
                   : ray_uncounted ? "none given (HEAD_ADDR, HEAD_PORT and RANK alone): the other nodes join the Ray "
                                     "head as they start"
                                   : "default");
  if (p.nnodes < 1) throw ConfigError(fmt::format("--nnodes {}: expected a positive number", p.nnodes));
  if (o.min_nodes) set_elastic(p, o, env, *o.min_nodes, *o.nnodes, fmt::format("--nnodes {}:{}", *o.min_nodes, *o.nnodes));
  else if (!o.nnodes && sched.min_nodes)
    set_elastic(p, o, env, sched.min_nodes->value, p.nnodes, sched.min_nodes->source);
  else if (ranks_at_rendezvous(o, sched))
    // torchrun's documented multi-node line, typed alike on every node: with no node rank anywhere,
    // the agents number themselves as they meet, exactly as --nnodes N:N does (torchrun's c10d).
    set_elastic(p, o, env, p.nnodes, p.nnodes,
                fmt::format("--nnodes {} with {} and no --node-rank: node ranks are assigned at the rendezvous",
                            p.nnodes, o.rdzv_endpoint ? "--rdzv-endpoint" : "--rdzv-backend c10d"));
  int node_rank = p.elastic ? 0 : o.node_rank ? *o.node_rank : sched.node_rank ? sched.node_rank->value : 0;
  std::string node_rank_source = p.elastic ? "the rendezvous, at each generation" + std::string(o.node_rank ? " (--node-rank is ignored)" : "")
                                 : o.node_rank ? "--node-rank" : sched.node_rank ? sched.node_rank->source : "default";
  source("node rank", node_rank_source);
  if (node_rank < 0 || node_rank >= p.nnodes)
    throw ConfigError(fmt::format("node rank {} ({}) must be below the node count {} ({})", node_rank,
                                  node_rank_source, p.nnodes, p.source_of("nnodes")));
  int nproc = 1;
  std::string nproc_source = "default";
  if (nproc_flag) {
    nproc = *nproc_flag;
    nproc_source = nproc_flag_name + (nproc_how.empty() ? "" : " (" + nproc_how + ")");
  } else if (sched.nproc_per_node) {
    nproc = sched.nproc_per_node->value;
    nproc_source = sched.nproc_per_node->source;
  } else if (o.np) {
    if (*o.np % p.nnodes != 0)
      throw ConfigError(fmt::format("-n {} does not divide evenly over {} nodes", *o.np, p.nnodes));
    nproc = *o.np / p.nnodes;
    nproc_source = "-n";
  } else if (gpus_here) {
    nproc = *gpus_here;
    nproc_source = "--gpus-per-node (one rank per GPU)";
  }
  if (o.np && *o.np != nproc * p.nnodes)
    throw ConfigError(fmt::format("-n {} disagrees with {} processes per node ({}) on {} nodes", *o.np, nproc,
                                  nproc_source, p.nnodes));
  source("nproc per node", nproc_source);
  p.world_size = nproc * p.nnodes;
  p.this_node = node_rank;
  if (sched.rank_table && sched.rank_table->servers.size() == size_t(p.nnodes) &&
      sched.rank_table->servers.front().devices.size() == size_t(nproc)) {
    for (const auto& server : sched.rank_table->servers)
      for (const auto& d : server.devices) p.rank_table_slots.emplace_back(d.device_id, d.rank_id);
    p.rank_table_size = sched.rank_table->rank_size;
  }
  for (int i = 0; i < p.nnodes; ++i)
    p.nodes.push_back(NodePlan{i, i == node_rank ? machine.hostname : fmt::format("node{}", i), i == node_rank,
                               i * nproc, nproc});
  if (p.elastic) {
    // This node alone until the first generation closes (the job then sets the real layout).
    p.nodes.resize(1);
    p.nnodes = 1;
    p.world_size = nproc;
  }
  if (p.nnodes == 1 && !p.elastic && !ray_uncounted) {
    p.mode = Mode::kLocal;
    p.master_addr = "127.0.0.1";
    source("store address", "local job: loopback");
    p.master_port = o.master_port ? *o.master_port : sched.master_port ? sched.master_port->value : 0;
    source("store port", o.master_port ? "--master-port"
                         : sched.master_port ? sched.master_port->source
                                             : "chosen by the OS");
  } else {
    p.mode = Mode::kPerNode;
    if (o.master_addr) {
      p.master_addr = *o.master_addr;
      source("store address", "--master-addr");
    } else if (sched.master_addr) {
      p.master_addr = sched.master_addr->value;
      source("store address", sched.master_addr->source);
    } else if (o.ray && sched.ray_head_addr) {
      p.master_addr = sched.ray_head_addr->value;
      source("store address", "HEAD_ADDR (node 0: the Ray head hosts the job's store too)");
    } else {
      throw ConfigError(p.elastic ? fmt::format("--nnodes {}:{} needs --master-addr or --rdzv-endpoint (the host "
                                                "whose agent hosts the job's store) or MASTER_ADDR",
                                                p.min_nodes, p.max_nodes)
                                  : fmt::format("--nnodes {} needs --master-addr (the address of node 0) or MASTER_ADDR",
                                                p.nnodes));
    }
    p.master_port = o.master_port           ? *o.master_port
                    : sched.master_port         ? sched.master_port->value
                    : sched.default_master_port ? sched.default_master_port->value
                                                : 29500;
    source("store port", o.master_port                 ? "--master-port"
                         : sched.master_port         ? sched.master_port->source
                         : sched.default_master_port ? sched.default_master_port->source
                                                     : "default (29500, as torchrun)");
  }
  p.host_store = node_rank == 0;
  if (p.elastic) {
    // The agent on the master address's host hosts the store (the first of several there to bind
    // its port: the others find it in use and join as clients).
    p.host_store = is_local_host(p.master_addr, machine.hostname) ||
                   std::find(machine.addresses.begin(), machine.addresses.end(), p.master_addr) !=
                       machine.addresses.end();
    if (o.ps || sched_ps_nodes)
      throw ConfigError("--nnodes MIN:MAX and a parameter-server job (--ps, TF_CONFIG ps entries) cannot be combined: "
                        "parameter servers hold state that a new generation would lose");
  }
}

}  // namespace cohort::launch
