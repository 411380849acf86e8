#include "common/affinity.h"

#include <sched.h>

#include <set>

#include <fmt/format.h>

#include "cohort/error.h"
#include "common/env.h"

namespace cohort::affinity {
namespace {
const env::StringSetting kYield("COHORT_YIELD", "auto",
                                "whether waits that spin yield the core: auto (only where the local ranks' CPU "
                                "sets overlap), 1 (always), 0 (never)");
}  // namespace

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

bool disjoint(const std::vector<std::vector<int>>& sets) {
  std::set<int> seen;
  for (const auto& s : sets) {
    if (s.empty()) return false;
    for (int c : s)
      if (!seen.insert(c).second) return false;
  }
  return true;
}

YieldChoice choose_yield(const std::vector<std::vector<int>>& local_sets) {
  const std::string setting = kYield.get();
  if (setting == "1") return {true, "waits yield the core (COHORT_YIELD=1)"};
  if (setting == "0") return {false, "waits never yield (COHORT_YIELD=0)"};
  if (setting != "auto") throw ConfigError(fmt::format("COHORT_YIELD={}: expected auto, 0 or 1", setting));
  if (local_sets.size() <= 1) return {false, "waits spin without yielding (no other rank on this host)"};
  if (disjoint(local_sets)) return {false, "waits spin without yielding (every local rank has CPUs of its own)"};
  return {true, "waits yield the core after 1 us (the local ranks' CPU sets overlap)"};
}

}  // namespace cohort::affinity
