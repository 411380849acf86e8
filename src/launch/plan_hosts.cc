// Placement by one launcher that starts every host (mpirun's and DeepSpeed's way): the hosts of -H,
// --hostfile or the Slurm allocation the launcher runs in, each with its slots, and mpirun's two steps
// over them: the mapping (--map-by: how many processes each host runs) and the ranking (--rank-by:
// which ranks they are). The head starts an agent on every other host (launch/job_fanout.cc).

#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "cohort/error.h"
#include "common/strings.h"
#include "launch/plan_internal.h"

namespace cohort::launch {
namespace {

// mpirun takes its --map-by and --rank-by words in any case (NODE, Slot).
std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

// mpirun's --map-by, in the forms that say something cohort's placement and binding can do: `slot`
// is cohort's placement (each node's slots in turn), `node` deals the processes round robin over the
// hosts (mpirun_counts_by_node), `ppr:N:node` is N processes per node, `core` binds each local rank to
// a CPU and `socket`/`numa` to a NUMA node (cohort knows NUMA nodes, not sockets: on the usual
// one-node-per-socket machine they are the same), unless --bind-to says otherwise.
MapBy apply_map_by(const std::string& given, std::string& bind_to) {
  std::string form = lower(given);
  const char* supported = "supported: slot, node, ppr:N:node, core, socket, numa";
  if (form == "slot") return {};
  if (form == "node") return MapBy{std::nullopt, true};
  if (form == "core" || form == "socket" || form == "numa") {
    if (bind_to == "auto") bind_to = form == "core" ? "core" : "numa";
    return {};
  }
  auto parts = str::split(form, ':', true);
  if (parts.size() == 3 && parts[0] == "ppr" && parts[2] == "node") {
    char* end = nullptr;
    long n = std::strtol(parts[1].c_str(), &end, 10);
    if (parts[1].empty() || *end != '\0' || n < 1 || n > 100000)
      throw ConfigError(fmt::format("--map-by {}: expected ppr:N:node with N a positive number", given));
    return MapBy{static_cast<int>(n), false};
  }
  throw ConfigError(fmt::format("--map-by {}: not a form cohort maps ({}; modifiers such as :PE=n and "
                                "ppr:N:socket are not)",
                                given, supported));
}

// How many of `n` processes each host gets, hosts in the order given with `slots[i]` slots each, as
// Open MPI 4.1's mapper by slot (its default) places them: each host's slots in turn. Beyond the slots
// (--oversubscribe) the processes left are dealt evenly over the hosts, the first hosts taking one more
// when they do not divide.
std::vector<int> mpirun_counts_by_slot(const std::vector<int>& slots, int n) {
  const int hosts = static_cast<int>(slots.size());
  int total = 0;
  for (int s : slots) total += s;
  std::vector<int> counts(slots.size(), 0);
  const int extra = std::max(0, n - total);
  for (int i = 0, left = n; i < hosts && left > 0; ++i) {
    const int here = slots[size_t(i)] + extra / hosts + (i < extra % hosts ? 1 : 0);
    counts[size_t(i)] = std::min(here, left);
    left -= counts[size_t(i)];
  }
  return counts;
}

// The same for --map-by node, as Open MPI 4.1's by-node mapper (orte_rmaps_rr_bynode) computes it: in
// passes, the processes left are shared evenly over the hosts that took some in the pass before (all
// hosts at first), the first of them taking one more when they do not divide (and each at least one);
// a host takes no more than its free slots, and a full host sits the pass out. Beyond the slots
// (--oversubscribe) every host just takes its share, slots or not. (So -n 6 over a:1,b:4,c:2 gives
// a 1, b 3, c 2: b takes the one a could not.)
std::vector<int> mpirun_counts_by_node(const std::vector<int>& slots, int n) {
  int total = 0;
  for (int s : slots) total += s;
  const bool beyond_slots = n > total;
  std::vector<int> counts(slots.size(), 0);
  int placed = 0;
  int takers = static_cast<int>(slots.size());
  // Every pass places at least one process while a host has a free slot (or beyond the slots, where the
  // first pass places them all), so the passes end.
  while (placed < n && takers > 0) {
    const int left = n - placed;
    const int share = std::max(1, left / takers);
    int one_more = std::max(0, left - share * takers);  // hosts taking share + 1
    takers = 0;
    for (size_t h = 0; h < slots.size() && placed < n; ++h) {
      const int free = slots[h] - counts[h];
      if (!beyond_slots && free <= 0) continue;
      int take = share;
      if (one_more > 0) {
        ++take;
        --one_more;
      }
      if (!beyond_slots) take = std::min(take, free);
      take = std::min(take, n - placed);
      counts[h] += take;
      placed += take;
      ++takers;
    }
  }
  return counts;
}

// mpirun's --rank-by node: the ranks are dealt round robin over the hosts (host order), one per host
// that still has an unnumbered process in each round, until every process has one. Per host, its
// ranks in local-index order.
std::vector<std::vector<int>> mpirun_ranks_by_node(const std::vector<int>& counts) {
  std::vector<std::vector<int>> ranks(counts.size());
  int next = 0;
  for (int round = 0, dealt = 1; dealt > 0; ++round) {
    dealt = 0;
    for (size_t h = 0; h < counts.size(); ++h)
      if (round < counts[h]) {
        ranks[h].push_back(next++);
        ++dealt;
      }
  }
  return ranks;
}

}  // namespace

void read_mapping(Plan& p, const Options& o, Shape& shape, std::string& bind_to) {
  auto source = [&](const std::string& setting, const std::string& from) { p.sources.emplace_back(setting, from); };
  if (o.map_by) {
    shape.map_by = apply_map_by(*o.map_by, bind_to);
    if (auto ppr = shape.map_by.per_node) {
      if (shape.nproc_flag && *shape.nproc_flag != *ppr)
        throw ConfigError(fmt::format("--map-by {} and {} {} disagree about the processes per node", *o.map_by,
                                      o.nproc_per_node_flag, *o.nproc_per_node));
      shape.nproc_flag = *ppr;
      shape.nproc_how.clear();
      shape.nproc_flag_name = "--map-by " + *o.map_by;
    }
    source("map-by", "--map-by " + *o.map_by);
  }
  // mpirun's --rank-by: `slot` numbers each host's processes in turn (torchrun's order too), `node` deals
  // the ranks round robin over the hosts. Without it the ranks follow the mapping, as Open MPI's do:
  // by node after --map-by node, by slot otherwise.
  shape.rank_by_node = shape.map_by.by_node;
  shape.rank_by_flag = shape.map_by.by_node ? "--map-by " + *o.map_by : "";
  if (o.rank_by) {
    const std::string form = lower(*o.rank_by);
    if (form != "slot" && form != "node")
      throw ConfigError(fmt::format("--rank-by {}: cohort numbers ranks by slot (each host's processes in turn) or "
                                    "by node (round robin over the hosts); supported: slot, node",
                                    *o.rank_by));
    shape.rank_by_node = form == "node";
    shape.rank_by_flag = "--rank-by " + *o.rank_by;
    source("rank-by", shape.rank_by_flag);
  }
  if (shape.rank_by_node && o.ps)
    throw ConfigError(fmt::format("{} and --ps both given: a parameter-server job keeps each node's processes "
                                  "consecutive (its workers, then its servers); use --rank-by slot",
                                  shape.rank_by_flag));
}

std::optional<SlurmAllocation> fan_out_allocation(const Options& o, const EnvMap& env, const MachineFacts& machine) {
  if (o.launcher != "auto" && o.launcher != "ssh" && o.launcher != "srun")
    throw ConfigError(fmt::format("--launcher {}: expected auto, ssh or srun", o.launcher));
  // Inside a Slurm allocation (a batch script, an salloc shell), with no hosts and no per-node flags:
  // the allocation's nodes are the hosts, as mpirun takes them (docs/slurm.md). An allocation of this
  // one node alone stays a local job.
  std::optional<SlurmAllocation> slurm;
  if (!o.hosts && !o.hostfile && !o.nnodes && !o.node_rank) {
    slurm = read_slurm_allocation(env);
    if (slurm && slurm->nodes.size() == 1 && is_local_host(slurm->nodes.front().host, machine.hostname))
      slurm.reset();
  }
  if (o.launcher == "srun" && !slurm && !env.count("SLURM_JOB_ID"))
    throw ConfigError("--launcher srun: not inside a Slurm allocation (SLURM_JOB_ID is not set); run cohort run "
                      "in an sbatch script or an salloc shell");
  return slurm;
}

void place_on_hosts(Plan& p, const Options& o, const Shape& shape, const std::optional<SlurmAllocation>& slurm,
                    const MachineFacts& machine, PlacementFinds& found) {
  auto source = [&](const std::string& setting, const std::string& from) { p.sources.emplace_back(setting, from); };
  const std::optional<int>& nproc_flag = shape.nproc_flag;
  const std::string& nproc_flag_name = shape.nproc_flag_name;
  const MapBy& map_by = shape.map_by;
  const bool rank_by_node = shape.rank_by_node;
  std::optional<Sourced<std::string>>& sched_job_id = found.sched_job_id;
  // One launcher fans out to every host (mpirun / DeepSpeed style).
  if (o.hosts && o.hostfile) throw ConfigError("both -H and --hostfile given; use one of them");
  const char* hosts_flag = o.hosts ? "-H" : "--hostfile";
  if (o.nnodes || o.node_rank)  // (never with the allocation's hosts: they are read only without these)
    throw ConfigError(fmt::format("{} and --nnodes/--node-rank both given: {} starts every node itself, "
                                  "--nnodes is for running cohort once per node",
                                  hosts_flag, hosts_flag));
  auto hosts = slurm ? slurm->nodes : o.hosts ? parse_host_list(*o.hosts) : parse_hostfile(o.hostfile_text, *o.hostfile);
  std::string hosts_source = slurm    ? fmt::format("SLURM_JOB_NODELIST (Slurm job {}; slots: {})", slurm->job_id,
                                                    slurm->slots_source)
                             : o.hosts ? "-H " + *o.hosts
                                       : "--hostfile " + *o.hostfile;
  p.agent_launcher = o.launcher == "auto" ? (slurm ? "srun" : "ssh") : o.launcher;
  source("agent launcher", o.launcher == "auto" ? (slurm ? "inside a Slurm allocation" : "default") : "--launcher");
  if (slurm) sched_job_id = Sourced<std::string>{"slurm-" + slurm->job_id, "SLURM_JOB_ID"};
  if (nproc_flag)
    for (auto& h : hosts) h.slots = *nproc_flag;
  int total = 0;
  for (const auto& h : hosts) total += h.slots;
  int n = o.np.value_or(total);
  if (n > total && !o.oversubscribe)
    throw ConfigError(fmt::format("-n {} is more than the {} slots of {} (--oversubscribe places the rest on the "
                                  "same hosts)",
                                  n, total, hosts_source));
  std::string world_source = o.np ? "-n" : "sum of slots";
  if (n > total) world_source = fmt::format("-n, --oversubscribe: {} more than the {} slots", n - total, total);
  // mpirun's two steps: the mapping says how many processes each host runs, the ranking which ranks
  // they are (consecutive per host by slot; round robin over the hosts by node).
  std::vector<int> slots;
  for (const auto& h : hosts) slots.push_back(h.slots);
  const std::vector<int> counts = map_by.by_node ? mpirun_counts_by_node(slots, n) : mpirun_counts_by_slot(slots, n);
  const std::vector<std::vector<int>> dealt =
      rank_by_node ? mpirun_ranks_by_node(counts) : std::vector<std::vector<int>>{};
  p.mode = Mode::kFanOut;
  int rank = 0;
  int local_nodes = 0;
  p.this_node = -1;
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (counts[i] == 0) continue;  // a host the processes did not reach
    const auto& h = hosts[i];
    NodePlan node;
    node.node_rank = static_cast<int>(p.nodes.size());
    node.host = h.host;
    node.local = (is_local_host(h.host, machine.hostname) || (slurm && h.host == slurm->this_node)) &&
                 local_nodes == 0;
    if (node.local) {
      ++local_nodes;
      p.this_node = node.node_rank;
    }
    node.first_rank = rank;
    node.nproc = counts[i];
    rank += node.nproc;
    if (rank_by_node) {
      // A host whose dealt ranks happen to be consecutive (one host, one process each) keeps the
      // usual form.
      node.first_rank = dealt[i].front();
      if (dealt[i].back() - dealt[i].front() + 1 != node.nproc) node.ranks = dealt[i];
    }
    p.nodes.push_back(node);
  }
  p.nnodes = static_cast<int>(p.nodes.size());
  p.world_size = n;
  source("hosts", hosts_source);
  source("world size", world_source);
  if (nproc_flag) source("slots per host", nproc_flag_name);
  p.master_addr = o.master_addr.value_or(machine.hostname);
  source("store address", o.master_addr ? o.master_addr_flag : "this host's name");
  p.master_port = o.master_port.value_or(0);
  source("store port", o.master_port ? "--master-port" : "chosen by the OS");
  p.host_store = true;
}

}  // namespace cohort::launch
