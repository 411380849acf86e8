// CPU binding of each node's local ranks (--bind-to, --map-by core/numa): the CPU sets mpirun's binding
// would give, from this process's affinity, the machine's cores and NUMA nodes, and the CPUs near each
// rank's GPU.

#include <fmt/core.h>

#include <algorithm>
#include <fstream>
#include <map>

#include "common/strings.h"
#include "launch/plan_internal.h"

namespace cohort::launch {

std::vector<std::vector<int>> numa_node_cpus() {
  std::vector<std::vector<int>> nodes;
  for (int n = 0; n < 1024; ++n) {
    std::ifstream in(fmt::format("/sys/devices/system/node/node{}/cpulist", n));
    if (!in) break;
    std::string list;
    std::getline(in, list);
    list = std::string(str::trim(list));
    nodes.push_back(list.empty() ? std::vector<int>{} : str::parse_int_list(list, "NUMA cpulist"));
  }
  return nodes;
}

std::vector<std::vector<int>> physical_cores(const std::vector<int>& allowed) {
  std::map<std::pair<int, int>, std::vector<int>> by_core;  // (package, core id) -> logical CPUs
  for (int c : allowed) {
    auto read_id = [&](const char* what) {
      std::ifstream in(fmt::format("/sys/devices/system/cpu/cpu{}/topology/{}", c, what));
      int v = -1;
      if (!(in >> v)) v = -1;
      return v;
    };
    int package = read_id("physical_package_id"), core = read_id("core_id");
    // Unknown topology: the CPU counts as a core of its own.
    by_core[core < 0 ? std::make_pair(-1, c) : std::make_pair(package, core)].push_back(c);
  }
  std::vector<std::vector<int>> cores;
  for (auto& [id, cpus] : by_core) cores.push_back(cpus);
  std::sort(cores.begin(), cores.end());  // by lowest CPU number
  return cores;
}

namespace {

// Blocks of whole cores (of logical CPUs when there are fewer cores than ranks) for `n` ranks.
std::vector<std::vector<int>> core_blocks(size_t n, std::vector<std::vector<int>> cores) {
  std::vector<std::vector<int>> out(n);
  if (n > cores.size()) {
    std::vector<int> flat;
    for (const auto& core : cores) flat.insert(flat.end(), core.begin(), core.end());
    cores.clear();
    for (int c : flat) cores.push_back({c});
  }
  const size_t total = cores.size();
  for (size_t i = 0; i < n; ++i)
    for (size_t k = i * total / n; k < (i + 1) * total / n; ++k) out[i].insert(out[i].end(), cores[k].begin(), cores[k].end());
  return out;
}

// `cpus` restricted to `allowed`, in order.
std::vector<int> within(const std::vector<int>& cpus, const std::vector<int>& allowed) {
  std::vector<int> kept;
  for (int c : cpus)
    if (std::find(allowed.begin(), allowed.end(), c) != allowed.end()) kept.push_back(c);
  return kept;
}

// Each set (a core's CPUs, a NUMA node's) restricted to `allowed`; sets left empty are dropped.
std::vector<std::vector<int>> sets_within(const std::vector<std::vector<int>>& sets, const std::vector<int>& allowed) {
  std::vector<std::vector<int>> out;
  for (const auto& set : sets)
    if (auto kept = within(set, allowed); !kept.empty()) out.push_back(std::move(kept));
  return out;
}

// GPU-near blocks: ranks grouped by their GPU's CPU set (within `allowed`), each group's cores cut
// into blocks. Empty result: the locality is unknown or too small for the ranks it would hold.
std::vector<std::vector<int>> gpu_near_bindings(int nproc, const std::vector<int>& allowed,
                                                const std::vector<std::vector<int>>& cores,
                                                const std::vector<std::vector<int>>& near_cpus) {
  if (near_cpus.size() != static_cast<size_t>(nproc)) return {};
  std::map<std::vector<int>, std::vector<int>> groups;  // usable near CPUs -> local ranks
  for (int l = 0; l < nproc; ++l) {
    std::vector<int> usable = within(near_cpus[l], allowed);
    if (usable.empty()) return {};
    groups[usable].push_back(l);
  }
  std::vector<std::vector<int>> out(static_cast<size_t>(nproc));
  for (const auto& [cpus, ranks] : groups) {
    if (ranks.size() > cpus.size()) return {};
    auto blocks = core_blocks(ranks.size(), sets_within(cores, cpus));
    for (size_t i = 0; i < ranks.size(); ++i) out[ranks[i]] = blocks[i];
  }
  return out;
}

}  // namespace

std::vector<std::vector<int>> compute_bindings(const std::string& bind_to, int nproc, const std::vector<int>& allowed,
                                               const std::vector<std::vector<int>>& numa_nodes,
                                               const std::vector<std::vector<int>>& cores_in,
                                               const std::vector<std::vector<int>>& near_cpus) {
  std::vector<std::vector<int>> out(static_cast<size_t>(nproc));
  if (bind_to == "none" || allowed.empty()) return out;
  std::vector<std::vector<int>> all_cores = cores_in;
  if (all_cores.empty())
    for (int c : allowed) all_cores.push_back({c});
  if (bind_to == "auto" && !near_cpus.empty()) {
    // A GPU job: a rank's threads feed its GPU over PCIe; CPUs on the GPU's NUMA node avoid the
    // cross-socket hop for every copy and kernel launch.
    auto near = gpu_near_bindings(nproc, allowed, all_cores, near_cpus);
    if (!near.empty()) return near;
  }
  if (bind_to == "auto") {
    // Why bind by default: two ranks left to the scheduler on a busy machine migrate, share a CPU for
    // a while and ping-pong cache lines; the shared-memory allreduce then ran 2-6x slower on some runs
    // and not others (docs/performance.md). Blocks of whole cores keep a rank's threads together and
    // off its neighbours' cores.
    if (nproc <= 1 || static_cast<size_t>(nproc) > allowed.size()) return out;
    return core_blocks(static_cast<size_t>(nproc), all_cores);
  }
  if (bind_to == "core") {
    for (int i = 0; i < nproc; ++i) out[i] = {allowed[static_cast<size_t>(i) % allowed.size()]};
    return out;
  }
  // numa: the NUMA nodes that have CPUs this process may use, round-robin over local ranks.
  std::vector<std::vector<int>> usable = sets_within(numa_nodes, allowed);
  if (usable.empty()) usable.push_back(allowed);
  for (int i = 0; i < nproc; ++i) out[i] = usable[static_cast<size_t>(i) % usable.size()];
  return out;
}

std::vector<std::vector<int>> near_cpus_of(const std::vector<GpuAssignment>& gpus) {
  std::vector<std::vector<int>> out;
  for (const auto& g : gpus) {
    if (g.device < 0 || g.near_cpus.empty()) return {};
    out.push_back(g.near_cpus);
  }
  return out;
}

}  // namespace cohort::launch
