#pragma once
// Step flags between the ranks of one intra-host group, living in their shared segment.
//
// Every rank owns one cache line with a step counter. post() advances it; wait_all() waits until every
// peer's counter has reached ours. All ranks execute the same sequence of posts, so "peer reached my
// step" means "peer finished the phase before this one". Waiting spins on the peer's cache line first
// (no system call on the fast path), then sleeps on it with futex(2) in short slices, checking between
// slices whether the peer's process is gone (a pidfd per peer, poll()ed), whether a rank declared the
// group failed, and the deadline.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/fd.h"

namespace cohort::shm {

// One rank's control line in the segment. Only the owner writes `step` and `failed`; waiters add to
// `sleepers` before they futex-wait on `step`, so the owner knows whether a wake-up call is needed.
struct alignas(64) RankControl {
  std::atomic<uint32_t> step;
  std::atomic<uint32_t> sleepers;
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> failed;  // 1 once this rank gave up on the group (its error ends the others too)
};
static_assert(sizeof(RankControl) == 64);

class PeerSync {
 public:
  // `controls` points to local_size RankControl lines in the shared segment (zeroed by the creator).
  // spin: how long a wait busy-polls before it sleeps.
  PeerSync(RankControl* controls, int local_rank, int local_size, std::chrono::milliseconds timeout,
           std::chrono::nanoseconds spin);

  // First step, collective: publishes this process's pid, waits for everyone, opens the peers' pidfds.
  void start();

  void post();
  // Waits until every peer has posted as many steps as this rank. `what` names the operation for errors.
  void wait_all(const char* what) {
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && !reached(q)) wait_slow(q, what);
  }
  // Waits for one peer only.
  void wait_for(int peer, const char* what) {
    if (!reached(peer)) wait_slow(peer, what);
  }
  // Marks this rank failed so that waiting peers stop within one sleep slice.
  void mark_failed();

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  bool reached(int q) const {
    return static_cast<int32_t>(controls_[q].step.load(std::memory_order_acquire) - my_step_) >= 0;
  }
  void wait_slow(int q, const char* what);
  // A message naming a dead or failed peer, or empty.
  std::string check_peers(int waiting_for, const char* what);

  RankControl* controls_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  std::chrono::nanoseconds spin_;
  uint32_t my_step_ = 0;
  std::vector<UniqueFd> pidfds_;  // index = local rank; invalid for self and for peers in this process
  std::vector<int> pids_;
};

}  // namespace cohort::shm
