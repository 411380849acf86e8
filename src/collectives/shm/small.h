#pragma once
// Small messages inline with their flag (shm::Group's path for allreduce, broadcast and allgather of up
// to InlineLines::kCapacity bytes per rank; docs/algorithms-shm.md, "Small messages").
//
// The staged path of a small call costs two cache-line transfers one after the other: the waiter sees
// the peer's step in its control line, and only then misses on the peer's slot, a line elsewhere. Here
// the data travels in the line the waiter polls: each rank owns, per parity, kLines cache lines; the first
// starts with the round number it was written for (a 64-bit sequence, written last, with release order)
// and the call's signature, and the data follow from its byte 32 on, contiguous through the next lines.
// A reader polls that first line alone; when it shows the round, the data and the signature (compared
// with the peers' calls for MismatchError at no further transfer) are there. One line carries 8 B and
// 32 B whole; larger data come in the following lines, which the reader fetches together (one copy or
// reduction over contiguous memory, where the hardware prefetcher helps).
//
// The group still posts its step after writing the lines: a waiter that spun past its short budget falls
// back to PeerSync's wait (yield, futex, deadline, dead-peer and failure checks) on that step, and every
// other path of the group keeps its invariant that all ranks post the same steps. A rank has kDepth sets
// of lines, used in turn by round (round % kDepth): a rank writes set t % kDepth in round t only after every
// peer arrived at round t - kDepth + 1, i.e. finished reading round t - kDepth. Where every rank waits for
// every rank each round that holds at once; the depth is for a broadcast's root, which does not wait
// (Group::broadcast_inline) and may so run up to kDepth - 1 rounds ahead of its receivers.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "transport/shm/sync.h"

namespace cohort::shm {

class InlineLines {
 public:
  static constexpr size_t kLine = 64;
  static constexpr size_t kLines = 16;      // per rank and round
  static constexpr unsigned kDepth = 8;     // sets of lines per rank, used in turn by round
  static constexpr size_t kHeader = 32;     // line 0: round (8), signature (24), then the data
  // Data bytes per rank and round: from byte 32 of line 0 on, contiguous through the following lines.
  static constexpr size_t kCapacity = kLines * kLine - kHeader;  // 992
  static_assert(sizeof(CallSignature) + 8 == kHeader);

  // The segment bytes the lines of `size` ranks take (a multiple of the line).
  static size_t area_bytes(int size) { return static_cast<size_t>(size) * kDepth * kLines * kLine; }

  InlineLines() = default;
  // `area`: area_bytes(size) of the shared segment, 64-byte aligned, zeroed by its creator.
  InlineLines(char* area, int rank) : area_(area), rank_(rank) {}

  // This rank's lines for `round`: `bytes` (<= kCapacity) of data and the signature. The data and the
  // signature first, the round last with release order: a reader that sees the round sees them.
  void write(uint64_t round, const CallSignature& call, const void* data, size_t bytes) const {
    char* base = lines(rank_, round);
    if (bytes) std::memcpy(base + kHeader, data, bytes);  // one copy: whole lines after the first
    std::memcpy(base + 8, &call, sizeof call);
    seq(base).store(round, std::memory_order_release);
  }
  // Takes this rank's lines for `round` (the header and the first `bytes` of data) into this core's cache
  // for writing, ahead of write(): a peer read them kDepth rounds earlier and still holds a copy, and a
  // store to a line another core holds waits for that copy's invalidation, a cross-core transfer, which
  // the post's fence after write() then waits for too. Done right after posting the round before, the
  // invalidation overlaps that round's wait for the peers instead of delaying the next round's lines.
  // A hint only (PREFETCHW): it changes no data; on a CPU without it the instruction does nothing.
  void claim(uint64_t round, size_t bytes) const {
    const char* base = lines(rank_, round);
    for (size_t off = 0; off < kHeader + bytes; off += kLine) prefetch_for_write(base + off);
  }
  // Whether rank q's lines for `round` are written (its round in line 0).
  bool ready(int q, uint64_t round) const { return seq(lines(q, round)).load(std::memory_order_acquire) == round; }
  // After ready(q, round): rank q's data (contiguous, kCapacity bytes at most) and signature.
  const char* data(int q, uint64_t round) const { return lines(q, round) + kHeader; }
  CallSignature signature(int q, uint64_t round) const {
    CallSignature c;
    std::memcpy(&c, lines(q, round) + 8, sizeof c);
    return c;
  }

 private:
  char* lines(int q, uint64_t round) const {
    return area_ + (static_cast<size_t>(q) * kDepth + round % kDepth) * kLines * kLine;
  }
  static void prefetch_for_write(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetchw %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 1, 3);
#endif
  }
  static std::atomic_ref<uint64_t> seq(const char* line) {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(const_cast<char*>(line)));
  }

  char* area_ = nullptr;
  int rank_ = 0;
};

}  // namespace cohort::shm
