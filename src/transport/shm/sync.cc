#include "transport/shm/sync.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <climits>
#include <cstring>

#include <fmt/format.h>

#include "cohort/error.h"
#include "common/deadline.h"

namespace cohort::shm {
namespace {

// Sleep slice: the longest a waiter sleeps before it looks at the peers' processes and the deadline
// again, so a dead peer is noticed well within the 2 s the design promises.
constexpr auto kSleepSlice = std::chrono::milliseconds(50);
// Busy-poll without any system call for this long before yielding the core between polls.
constexpr auto kPureSpin = std::chrono::microseconds(1);

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word lives in memory shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

int pidfd_open(int pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

}  // namespace

PeerSync::PeerSync(RankControl* controls, int local_rank, int local_size, std::chrono::milliseconds timeout,
                   std::chrono::nanoseconds spin)
    : controls_(controls), rank_(local_rank), size_(local_size), timeout_(timeout), spin_(spin) {
  pidfds_.resize(static_cast<size_t>(local_size));
  pids_.assign(static_cast<size_t>(local_size), 0);
}

void PeerSync::start() {
  controls_[rank_].pid.store(::getpid(), std::memory_order_relaxed);
  post();
  wait_all("the group's start");
  for (int q = 0; q < size_; ++q) {
    pids_[q] = controls_[q].pid.load(std::memory_order_relaxed);
    if (q == rank_ || pids_[q] == ::getpid()) continue;  // ranks as threads of this process
    int fd = pidfd_open(pids_[q]);
    if (fd < 0) {
      if (errno == ESRCH)
        throw PeerLostError(fmt::format("shm: local rank {} (pid {}) exited while the group was starting", q, pids_[q]));
      // Older kernels: fall back to kill(pid, 0) checks (pidfds_[q] stays invalid).
      continue;
    }
    pidfds_[q] = UniqueFd(fd);
  }
}

std::string PeerSync::name(int q) const {
  return namer_ ? namer_(q) : fmt::format("local rank {}", q);
}

void PeerSync::post() {
  ++my_step_;
  RankControl& me = controls_[rank_];
  // seq_cst store then seq_cst load: pairs with the waiter's sleepers increment and re-check, so either
  // the waiter sees the new step or we see its sleepers count and wake it.
  me.step.store(my_step_, std::memory_order_seq_cst);
  if (me.sleepers.load(std::memory_order_seq_cst) != 0) futex(&me.step, FUTEX_WAKE, INT_MAX, nullptr);
}

void PeerSync::mark_failed() {
  RankControl& me = controls_[rank_];
  me.failed.store(1, std::memory_order_seq_cst);
  // Wake everyone sleeping on our step (without changing it) so they look at `failed` promptly; ranks
  // waiting on someone else notice within one sleep slice.
  futex(&me.step, FUTEX_WAKE, INT_MAX, nullptr);
}

std::string PeerSync::check_peers(int waiting_for, const char* what) {
  // Dead processes first: when a rank dies, the peer that noticed it first marks itself failed, and the
  // others should still name the root cause (the dead rank), not the messenger.
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    bool gone = false;
    if (pidfds_[q]) {
      pollfd p{pidfds_[q].get(), POLLIN, 0};
      gone = ::poll(&p, 1, 0) > 0;  // a pidfd becomes readable when the process exits
    } else if (pids_[q] > 0 && pids_[q] != ::getpid()) {
      gone = ::kill(pids_[q], 0) != 0 && errno == ESRCH;
    }
    if (gone)
      return fmt::format("shm: {} (pid {}) exited during {} ({} was waiting for {})", name(q), pids_[q], what,
                         name(rank_), name(waiting_for));
  }
  for (int q = 0; q < size_; ++q) {
    if (q != rank_ && controls_[q].failed.load(std::memory_order_acquire) != 0)
      return fmt::format("shm: {} (pid {}) failed during {}; {} stops too", name(q), pids_[q], what, name(rank_));
  }
  return {};
}

namespace {
thread_local bool t_always_yield = false;
}  // namespace

void PeerSync::set_thread_always_yields(bool on) { t_always_yield = on; }

void PeerSync::wait_slow(int q, const char* what) {
  RankControl& peer = controls_[q];
  // Phase 1: spin on the peer's cache line (reads only; the line stays shared until the peer writes).
  // The first microseconds are a pure spin: no system call when the peer is about to arrive. After
  // that each round also yields the core (unless set_yield(false): every rank has a core of its own):
  // when ranks share cores the peer we wait for may be waiting for ours.
  const auto spin_start = std::chrono::steady_clock::now();
  const auto pure_until = spin_start + std::min<std::chrono::nanoseconds>(spin_, kPureSpin);
  const auto spin_until = spin_start + spin_;
  bool yielding = false;
  for (unsigned i = 1;; ++i) {
    if (reached(q)) return;
    if (yielding) {
      ::sched_yield();
    } else {
      _mm_pause();
    }
    if ((i & 63) == 0 || yielding) {
      if (watch_) watch_(q);
      auto now = std::chrono::steady_clock::now();
      if (now >= spin_until) break;
      yielding = (yield_ || t_always_yield) && now >= pure_until;
    }
  }
  // Phase 2: futex sleeps in short slices, checking the peers and the deadline between them.
  const Deadline deadline = Deadline::after(timeout_);
  for (;;) {
    peer.sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t seen = peer.step.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - my_step_) < 0) {
      timespec ts{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kSleepSlice).count()};
      futex(&peer.step, FUTEX_WAIT, seen, &ts);
    }
    peer.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(q)) return;
    if (watch_) watch_(q);
    if (std::string lost = check_peers(q, what); !lost.empty()) {
      // A peer may exit normally once it has seen everyone's last post; if the one we wait for has
      // arrived in the meantime, this wait is over and the exit was not a failure of it.
      if (reached(q)) return;
      throw PeerLostError(lost);
    }
    if (deadline.expired())
      throw TimeoutError(fmt::format("shm: {} waited {} ms in {} for {} (pid {}), which did "
                                     "not arrive (it is at step {}, this rank at {})",
                                     name(rank_), timeout_.count(), what, name(q), pids_[q],
                                     peer.step.load(std::memory_order_relaxed), my_step_));
  }
}

}  // namespace cohort::shm
