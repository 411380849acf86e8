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
#include <functional>
#include <string>
#include <vector>

#include "common/fd.h"

namespace cohort::shm {

// What a rank called (the communicator's operation number and signature), published in its control
// line before the operation's first post so that the peers can compare it with their own call.
struct CallSignature {
  uint64_t count = 0;
  uint32_t seq = 0;   // the communicator's operation number
  uint32_t root = 0;
  uint8_t kind = 0;   // comm's op kind (allreduce, broadcast, ...)
  uint8_t dtype = 0;
  uint8_t op = 0;     // reduce op
  uint8_t flags = 0;
  uint32_t reserved = 0;
  bool operator==(const CallSignature&) const = default;
};
static_assert(sizeof(CallSignature) == 24);

// One rank's control line in the segment. Only the owner writes `step`, `failed` and `call`; waiters
// add to `sleepers` before they futex-wait on `step`, so the owner knows whether a wake-up call is
// needed. `call` has two entries (alternating per group call): a peer may run one call ahead of a
// slow rank, and must not overwrite the signature the slow rank has yet to compare. The signatures
// share the line with `step`, so comparing them costs no extra cache-line transfer.
struct alignas(64) RankControl {
  std::atomic<uint32_t> step;
  std::atomic<uint32_t> sleepers;
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> failed;  // 1 once this rank gave up on the group (its error ends the others too)
  CallSignature call[2];         // written before a post, read by peers after they saw that post
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

  // Called now and then while a wait has not completed (every few dozen spins, after every sleep
  // slice) with the local rank waited for; it may throw to end the wait (abort, deadline of the
  // caller). Not called on the fast path (peer already there).
  void set_watch(std::function<void(int local_peer)> watch) { watch_ = std::move(watch); }
  // Names a local rank in error messages (e.g. "rank 3 (host-a)"); default "local rank N".
  void set_peer_namer(std::function<std::string(int local_peer)> namer) { namer_ = std::move(namer); }
  // Whether a wait yields the core (sched_yield) after its first microsecond of spinning. Needed when
  // the rank waited for may need this core (more runnable ranks than cores, unbound ranks); harmful
  // when every rank has a core of its own: the yield hands this core to whatever else runs on the
  // host, and the wait lasts that process's time slice (Group decides, docs/algorithms-shm.md).
  void set_yield(bool yield) { yield_ = yield; }
  bool yields() const { return yield_; }
  // For the calling thread only: its waits always yield, whatever set_yield says. The communicator's
  // progress thread shares its process's cores with the caller's compute threads (a bound rank: one
  // core for both), which must get the core while it waits.
  static void set_thread_always_yields(bool on);
  // Local ranks that have not yet posted as many steps as this rank.
  std::vector<int> lagging() const {
    std::vector<int> out;
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && !reached(q)) out.push_back(q);
    return out;
  }
  RankControl& control(int q) const { return controls_[q]; }
  // The process of local rank q as it published itself at start(); the name errors give it.
  int pid_of(int q) const { return pids_[static_cast<size_t>(q)]; }
  std::string peer_name(int q) const { return name(q); }

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
  bool yield_ = true;
  uint32_t my_step_ = 0;
  std::vector<UniqueFd> pidfds_;  // index = local rank; invalid for self and for peers in this process
  std::vector<int> pids_;
  std::function<void(int)> watch_;
  std::function<std::string(int)> namer_;
  std::string name(int q) const;
};

}  // namespace cohort::shm
