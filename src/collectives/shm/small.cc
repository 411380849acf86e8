// shm::Group's small-message path: allreduce, broadcast and allgather inline with their flag
// (collectives/shm/small.h has the layout and why; docs/algorithms-shm.md, "Small messages").
#include <immintrin.h>

#include <chrono>

#include <fmt/format.h>

#include "cohort/error.h"
#include "collectives/reduce_kernels.h"
#include "collectives/shm/group.h"
#include "collectives/shm/small.h"
#include "common/env.h"

namespace cohort::shm {
namespace {

const env::BoolSetting kInlineSmall("COHORT_SHM_INLINE", true,
                                    "intra-host allreduce, broadcast and allgather of up to 992 bytes per rank "
                                    "travel in the cache lines their ranks poll (off: through the staging slots)");

const env::BoolSetting kEarlyRoot("COHORT_SHM_EARLY_ROOT", true,
                                  "the root of an intra-host broadcast that fits one round returns without "
                                  "waiting for the receivers; its next call waits for their arrival first");

// How long a wait polls the peers' lines before it falls back to the group's wait on their step (which
// spins on, then yields and sleeps, with the deadline and dead-peer checks). Short: under load the
// fallback's yield is what lets a descheduled peer run.
constexpr auto kLinePoll = std::chrono::nanoseconds(500);

const env::BoolSetting kClaimLines("COHORT_SHM_CLAIM_LINES", true,
                                   "a rank takes its next round's small-message cache lines for writing "
                                   "(PREFETCHW) while it waits in this round, not when it writes them");

}  // namespace

bool inline_small_from_env() { return kInlineSmall.get(); }
bool claim_lines_from_env() { return kClaimLines.get(); }
bool early_root_from_env() { return kEarlyRoot.get(); }

bool Group::early_root_for(size_t bytes) const {
  return options_.early_root && inline_for(bytes) && !single_copy_for(bytes);
}

bool Group::inline_for(size_t bytes_per_rank) const {
  return options_.inline_small && size_ > 1 && bytes_per_rank <= InlineLines::kCapacity;
}

uint64_t Group::inline_round(const char* what, const void* data, size_t bytes, int root) {
  next_parity();
  const uint64_t t = round_;  // the round just begun; equal on every rank, never 0
  // A broadcast's root sends the data; the others only arrive (line 0: the round and their signature).
  const size_t written = root < 0 || root == rank_ ? bytes : 0;
  inline_.write(t, active_, data, written);
  sync_.post();
  // The next round's lines, taken for writing while this one waits (small.h, InlineLines::claim); a loop
  // of calls mostly repeats its size.
  if (options_.claim_lines) inline_.claim(t + 1, written);
  bool spun_out = false;
  // The poll's budget is timed from its 8th look on: a call whose peers are there by then (the usual
  // case in a loop) reads no clock at all (24 ns, bench/comm_call_bench.cc).
  std::chrono::steady_clock::time_point start;
  for (unsigned i = 1;; ++i) {
    bool all = true;
    for (int q = 0; q < size_; ++q)
      if (q != rank_) all &= inline_.ready(q, t);
    if (all) break;
    _mm_pause();
    if ((i & 7) == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (i == 8) {
        start = now;
      } else if (now - start >= kLinePoll) {
        spun_out = true;
        break;
      }
    }
  }
  bool same = !tally_.enabled;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    if (spun_out) {
      // The peer posts its step after writing its lines, so once the step is there the lines are too,
      // unless the peer called something else (then the signatures below tell).
      sync_.wait_for(q, what);
      if (!inline_.ready(q, t)) {
        check_calls();  // throws MismatchError naming both calls
        throw std::logic_error(fmt::format("shm {}: local rank {} posted round {} without its data", what, q, t));
      }
    }
    same = same && inline_.signature(q, t) == active_;
  }
  // The signatures in line 0 are the ones in the control lines: compared here, the control lines need
  // not travel. A shareable call, whose tally check_calls computes, takes the full check; a difference is
  // named from the lines (a broadcast's root that does not wait publishes its call there only).
  if (same) {
    compare_pending_ = false;
  } else if (tally_.enabled) {
    check_calls();
  } else {
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const CallSignature theirs = inline_.signature(q, t);
      if (theirs == active_) continue;
      throw MismatchError(mismatch_formatter_ ? mismatch_formatter_(q, theirs, active_)
                                              : fmt::format("mismatched calls: local rank {} called op {} (count {}, "
                                                            "seq {}) but local rank {} called op {} (count {}, seq {})",
                                                            q, theirs.kind, theirs.count, theirs.seq, rank_,
                                                            active_.kind, active_.count, active_.seq));
    }
    compare_pending_ = false;
  }
  ++inline_calls_;
  return t;
}

bool Group::poll_lines(int q, uint64_t round) const {
  std::chrono::steady_clock::time_point start;
  for (unsigned i = 1;; ++i) {
    if (inline_.ready(q, round)) return true;
    _mm_pause();
    if ((i & 7) == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (i == 8) start = now;
      else if (now - start >= kLinePoll) return false;
    }
  }
}

void Group::confirm_early_broadcasts() {
  if (!failure_.empty() || unconfirmed_count_ == 0) return;
  confirm_arrivals(UINT64_MAX);
}

void Group::confirm_arrivals(uint64_t through) {
  // A peer's lines of round r show r from its arrival there until it writes round r + kDepth, which
  // it does only after this rank's lines of that round, which come after this confirmation.
  while (unconfirmed_count_ > 0 && unconfirmed_[unconfirmed_first_].round <= through) {
    const Unconfirmed u = unconfirmed_[unconfirmed_first_];
    unconfirmed_first_ = (unconfirmed_first_ + 1) % InlineLines::kDepth;
    --unconfirmed_count_;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      if (!poll_lines(q, u.round)) {
        // Not there yet: the group's wait (spin, yield, sleep, deadline, dead peer) for its step, which
        // it posts after its lines; then the lines are there unless it called something else.
        sync_.wait_for(q, "broadcast");
        if (!inline_.ready(q, u.round)) {
          const CallSignature theirs = last_call_of(q);
          throw MismatchError(mismatch_formatter_ ? mismatch_formatter_(q, theirs, u.call)
                                                  : fmt::format("mismatched calls: local rank {} called op {} (count "
                                                                "{}, seq {}) where local rank {} broadcast (seq {})",
                                                                q, theirs.kind, theirs.count, theirs.seq, rank_,
                                                                u.call.seq));
        }
      }
      const CallSignature theirs = inline_.signature(q, u.round);
      if (!(theirs == u.call))
        throw MismatchError(mismatch_formatter_ ? mismatch_formatter_(q, theirs, u.call)
                                                : fmt::format("mismatched calls: local rank {} called op {} (count {}, "
                                                              "seq {}) but local rank {} called op {} (count {}, seq {})",
                                                              q, theirs.kind, theirs.count, theirs.seq, rank_,
                                                              u.call.kind, u.call.count, u.call.seq));
    }
  }
}

void Group::allreduce_inline(const void* in, void* out, size_t count, DataType dtype, ReduceOp op) {
  const size_t bytes = count * dtype_size(dtype);
  const uint64_t t = inline_round("allreduce", in, bytes, -1);
  if (bytes == 0) return;
  // Straight from every rank's lines (this rank's own too: `in` may be `out`, and a rank >= 2 would read
  // its input after the first step wrote `out`), in rank order, so every rank gets the same bits.
  kernels::reduce_to(out, inline_.data(0, t), inline_.data(1, t), count, dtype, op);
  for (int q = 2; q < size_; ++q) kernels::reduce_into(out, inline_.data(q, t), count, dtype, op);
  if (op == ReduceOp::kAvg) kernels::finish_average(out, count, dtype, size_);
}

void Group::allgather_inline(const void* in, void* out_v, size_t bytes) {
  char* out = static_cast<char*>(out_v);
  // In place (in == out, include/cohort/communicator.h) the contribution is already in its block.
  const void* mine = in == out_v ? out + static_cast<size_t>(rank_) * bytes : in;
  const uint64_t t = inline_round("allgather", mine, bytes, -1);
  // Each block from its rank's lines, this rank's too (its input may be its block of the output).
  for (int q = 0; q < size_; ++q)
    if (bytes) std::memcpy(out + static_cast<size_t>(q) * bytes, inline_.data(q, t), bytes);
}

void Group::broadcast_inline(void* data, size_t bytes, int root) {
  if (rank_ == root && early_root_for(bytes)) {
    // These lines are written again kDepth rounds on, after this rank has seen every peer arrive at the
    // round after this one (confirm_arrivals), i.e. finish reading this one: the receivers may read them
    // at their own pace. They compare the signatures at once; this rank compares theirs then, or at its
    // next call of another kind.
    next_parity();
    inline_.write(round_, active_, data, bytes);
    sync_.post();
    if (options_.claim_lines) inline_.claim(round_ + 1, bytes);
    leave_unconfirmed();
    ++inline_calls_;
    return;
  }
  const uint64_t t = inline_round("broadcast", data, bytes, root);
  if (rank_ != root && bytes) std::memcpy(data, inline_.data(root, t), bytes);
}

}  // namespace cohort::shm
