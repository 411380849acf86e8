// What the files of shm::Group share and no one outside it needs: cache-line slicing, overlap checks
// and the bodies of the two member templates every collective runs inside (`guarded`: the call's
// signature and failure handling; `single_copy_call`: the two rounds around a single-copy transfer).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>

#include "cohort/error.h"
#include "collectives/shm/group.h"

namespace cohort::shm {

constexpr size_t kPage = 4096;
constexpr size_t kLine = 64;

inline size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

inline size_t controls_bytes(int local_size) {
  return round_up(static_cast<size_t>(local_size) * sizeof(RankControl), kPage);
}

// Slice q of a chunk of `count` elements split among `parts` ranks, on cache-line boundaries.
struct Slices {
  size_t per;  // elements per slice (the last one may be shorter or empty)
  size_t count;
  Slices(size_t count_, int parts, size_t elem) : count(count_) {
    size_t align = std::max<size_t>(1, kLine / elem);
    per = round_up((count + static_cast<size_t>(parts) - 1) / static_cast<size_t>(parts), align);
  }
  size_t begin(int q) const { return std::min(count, per * static_cast<size_t>(q)); }
  size_t length(int q) const { return std::min(count, per * static_cast<size_t>(q + 1)) - begin(q); }
};

inline bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + bn && y < x + an;
}

template <typename Body>
void Group::guarded(const char* what, Body&& body, uint32_t shared_tag, bool tally, uint8_t group_flags) {
  if (!failure_.empty()) throw AbortedError("shm group failed earlier: " + failure_);
  try {
    // A broadcast root that did not wait for its receivers confirms their arrival before this call
    // writes anything: every round, unless this is another such broadcast, which reuses only the lines
    // of round round_ + 1 - kDepth (its own round is round_ + 1) and needs the arrival at the round after.
    if (unconfirmed_count_ > 0)
      confirm_arrivals(next_call_early_root_ ? round_ + 2 - InlineLines::kDepth : UINT64_MAX);
    // Publish this call's signature before its first post (the peers read it after seeing that post).
    active_ = call_;
    active_.reserved = shared_tag;
    active_.flags = static_cast<uint8_t>(active_.flags | group_flags);
    tally_ = Tally{tally, false, false};
    // An inline broadcast's root that does not wait leaves its control line alone: it may run several
    // calls ahead, and that entry may still hold a call a peer has yet to compare (its receivers compare
    // the signature in its lines). calls_ still counts it, so that every rank uses the same entries.
    if (!next_call_early_root_) sync_.control(rank_).call[calls_ & 1u] = active_;
    ++calls_;
    next_call_early_root_ = false;
    compare_pending_ = size_ > 1;
    body();
    if (compare_pending_) {
      // The call moved no data (zero bytes) and so had no round: run one anyway, so that its signature
      // is compared and no peer runs more than one call ahead (the two signature entries rely on it).
      next_parity();
      sync_.post();
      wait_all(what);
    }
  } catch (const InvalidArgument&) {
    throw;
  } catch (const std::exception& e) {
    failure_ = e.what();
    sync_.mark_failed();
    throw;
  }
}

template <typename Copies>
void Group::single_copy_call(const char* what, const uint64_t* header, size_t words, Copies&& copies) {
  // Round 1: my addresses are in my slot and my buffers hold what the peers copy (the signatures are
  // compared here too). The slot of this parity is written again two rounds later, after round 2,
  // when every peer has read my header.
  const unsigned p = next_parity();
  std::memcpy(slot(rank_, p), header, words * sizeof(uint64_t));
  sync_.post();
  wait_all(what);
  copies(p);
  // Round 2: every peer has finished copying from and into my buffers; the caller may reuse them.
  next_parity();
  sync_.post();
  wait_all(what);
  ++single_copies_;
}

}  // namespace cohort::shm
