#pragma once
// CPU affinity, and the rule for whether a rank that waits should yield its core.
//
// A wait that spins and finds nothing yields (sched_yield) so that a peer sharing the core can run.
// Where every rank of a host has cores of its own (cohort run's --bind-to, mpirun's binding) the yield
// only hands the core to an unrelated process, and the wait lasts that process's time slice: with two
// busy loops on a 2-core host, 8 B allreduce took 0.02-2 ms instead of under 1 us (shared memory) and
// 2 ms instead of 20 us (TCP). So ranks publish their CPU sets and waits yield only where they overlap
// (docs/algorithms-shm.md, "Whether a wait yields").

#include <string>
#include <vector>

namespace cohort::affinity {

// The CPUs the calling thread may run on, ascending; empty if the kernel does not say.
std::vector<int> allowed_cpus();

// True when every set is non-empty and no CPU is in two of them: every rank has cores of its own.
bool disjoint(const std::vector<std::vector<int>>& sets);

// COHORT_YIELD (auto, 0 or 1; ConfigError otherwise) applied to the local ranks' CPU sets: whether
// waits should yield, and a few words saying why.
struct YieldChoice {
  bool yield;
  std::string why;
};
YieldChoice choose_yield(const std::vector<std::vector<int>>& local_sets);

}  // namespace cohort::affinity
