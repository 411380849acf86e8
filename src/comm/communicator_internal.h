#pragma once
// What the parts of CommunicatorImpl (communicator_impl.h) share and nothing else needs: the timing
// constants of joining and of a lost peer, and two small helpers. Private to src/comm.
//
// CommunicatorImpl's parts, one file each:
//   communicator_impl.cc         construction and bootstrap (joining the store, transports, topology, shm)
//   communicator_exec.cc         running operations: the queue, the progress thread, waits, failures
//   communicator_exits.cc        the launcher's exit records: naming the rank that ended, and why
//   communicator_ops.cc          the collectives: validation, then the algorithm (blocking and async)
//   communicator_p2p.cc          point to point, receives from any source, their asynchronous handles
//   communicator_groups.cc       split, subgroup, allocate_shared, the link probe, abort
//   communicator_impl_shm.cc     the shared-memory group under the communicator's error semantics
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <cstdint>
#include <string>

#include <fmt/core.h>

#include "cohort/error.h"
#include "comm/communicator_impl.h"

namespace cohort::comm {

// The sequence number of point-to-point messages, outside every collective's.
constexpr uint32_t kP2PSeq = 0xFFFFFFFFu;

// How often a rank waiting for others to join reads the launcher's count of exits: a rank whose
// process ended is named within about this long (docs/errors.md, "Failure timing").
constexpr auto kExitPoll = std::chrono::seconds(1);
// How long a rank that lost a peer waits for the launcher's record of that peer's end before it fails
// without it: the launcher publishes within milliseconds of reaping the process, which the lost
// channel usually shows first. A peer on this host has this rank's launcher, alive (the rank would
// have died with it): its record comes. A peer on another host may have lost its launcher with it (a
// killed agent takes its ranks along), and then this rank's failure, and the ranks it tells, come this
// much later: a shorter wait.
constexpr auto kExitRecordWait = std::chrono::milliseconds(500);
constexpr auto kRemoteExitRecordWait = std::chrono::milliseconds(100);

// FNV-1a, folded to 32 bits: short stable names for store prefixes.
inline uint32_t hash32(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return uint32_t(h ^ (h >> 32));
}

inline std::string seconds_text(std::chrono::nanoseconds d) {
  return fmt::format("{:.1f} s", std::chrono::duration<double>(d).count());
}

// True on the thread that runs the *_async operations: its waits spin only while data is flowing
// (communicator_exec.cc).
extern thread_local bool t_progress_thread;

// How every wait of the transports is driven (communicator_exec.cc runs operations with it, and
// communicator_p2p.cc a receive from any source): a template, so that the loop's test is inlined.
template <typename Done>
void CommunicatorImpl::drive_until(Done done) {
  // Busy-poll only while data is moving: the budget restarts whenever a poll moved something, and
  // once it runs out the thread sleeps in epoll_wait (no CPU until a socket is ready). A blocking
  // caller keeps a generous budget (small-message latency); the progress thread of the *_async
  // operations a short one, so that it does not take cores from the caller's compute threads.
  const auto budget = t_progress_thread ? progress_spin_ : spin_;
  auto spin_until = Deadline::Clock::now() + budget;
  for (;;) {
    auto now = Deadline::Clock::now();
    if (now < spin_until) {
      bool progressed = false;
      for (auto& t : transports_) progressed = t->poll(0) || progressed;
      if (progressed) {
        spin_until = Deadline::Clock::now() + budget;
      } else {
        // Nothing ready: let another runnable thread (the peer rank, when ranks share cores; the
        // caller's compute threads, on the progress thread) have the core. Not where every local rank
        // has cores of its own: the yield would hand ours to an unrelated process for its time slice.
        if (yield_in_waits_ || t_progress_thread) sched_yield();
      }
    } else {
      auto until = std::min(op_deadline_.at(), next_warning_);
      long ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count();
      int timeout = int(std::clamp<long>(ms, 0, 100));
      bool woke = false;
      if (transports_.size() == 1) {
        woke = transports_.front()->poll(timeout);
      } else {
        for (auto& t : transports_) woke = t->poll(0) || woke;
        if (!woke)
          for (auto& t : transports_) woke = t->poll(std::min(timeout, 1)) || woke;
      }
      // Data is flowing again (a pipelined transfer): poll without sleeping for a while.
      if (woke) spin_until = Deadline::Clock::now() + budget;
    }
    if (done()) return;
    if (abort_requested_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> g(fail_mutex_);
      throw AbortedError(fmt::format("aborted: {}", abort_reason_));
    }
    now = Deadline::Clock::now();
    if (now >= op_deadline_.at()) throw_timeout();
    if (now >= next_warning_) {
      warn_slow(now - op_start_);
      warning_interval_ *= 2;
      next_warning_ = now + warning_interval_;
    }
  }
}

// COHORT_SHM_SHARED_BUFFERS (communicator_groups.cc): allocate_shared hands out memory the local
// peers map.
bool shm_shared_buffers_enabled();

}  // namespace cohort::comm
