#pragma once
// Small messages inline with their flag (shm::Group's path for allreduce, broadcast and allgather of up
// to InlineLines::kCapacity bytes per rank; docs/algorithms-shm.md, "Small messages").
//
// The staged path of a small call costs two cache-line transfers one after the other: the waiter sees
// the peer's step in its control line, and only then misses on the peer's slot, a line elsewhere. Here
// the data travels in the line the waiter polls: each rank owns, per parity, kLines cache lines, and
// every line starts with the round number it was written for (a 64-bit sequence, written last, with
// release order), so a line that shows the round already holds that round's data. The first line also
// carries the call's signature, so that comparing it with the peers' calls (MismatchError) costs no
// further transfer. The first line is written last, and a reader polls it alone, then reads the others.
//
// The group still posts its step after writing the lines: a waiter that spun past its short budget falls
// back to PeerSync's wait (yield, futex, deadline, dead-peer and failure checks) on that step, and every
// other path of the group keeps its invariant that all ranks post the same steps. Lines are reused every
// second round, like the slots: a rank writes parity p in round t only after every peer posted round t-1,
// i.e. finished reading round t-2.

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
  static constexpr size_t kLines = 16;      // per rank and parity
  static constexpr size_t kFirstData = 32;  // line 0: sequence (8), signature (24), data
  static constexpr size_t kNextData = 56;   // lines 1..: sequence (8), data
  // Data bytes per rank and round. Line data sizes are multiples of 8, so no element of any dtype is
  // split between two lines.
  static constexpr size_t kCapacity = kFirstData + (kLines - 1) * kNextData;  // 872
  static_assert(sizeof(CallSignature) + 8 + kFirstData == kLine);

  // The segment bytes the lines of `size` ranks take (a multiple of the line).
  static size_t area_bytes(int size) { return static_cast<size_t>(size) * 2 * kLines * kLine; }
  static size_t lines_for(size_t bytes) {
    return bytes <= kFirstData ? 1 : 1 + (bytes - kFirstData + kNextData - 1) / kNextData;
  }

  InlineLines() = default;
  // `area`: area_bytes(size) of the shared segment, 64-byte aligned, zeroed by its creator.
  InlineLines(char* area, int rank) : area_(area), rank_(rank) {}

  // This rank's lines for `round`: `bytes` (<= kCapacity) of data and the signature.
  void write(uint64_t round, const CallSignature& call, const void* data, size_t bytes) const {
    char* base = lines(rank_, round);
    const char* src = static_cast<const char*>(data);
    // Lines after the first, then the first: a reader that sees line 0 of this round has seen its
    // signature, and each line's own sequence covers that line's data.
    size_t off = kFirstData;
    for (size_t l = 1; off < bytes; ++l, off += kNextData) {
      char* line = base + l * kLine;
      std::memcpy(line + 8, src + off, std::min(kNextData, bytes - off));
      seq(line).store(round, std::memory_order_release);
    }
    std::memcpy(base + 8, &call, sizeof call);
    if (bytes) std::memcpy(base + 8 + sizeof call, src, std::min(kFirstData, bytes));
    seq(base).store(round, std::memory_order_release);
  }
  // Whether rank q's lines for `round` holding `bytes` are all written.
  bool ready(int q, uint64_t round, size_t bytes) const {
    const char* base = lines(q, round);
    // Line 0 is written last: polling only it leaves the other lines alone while their owner writes them
    // (a poll would pull each back and forth); once it shows the round, the others' loads are
    // independent, so their misses overlap. Each line's own sequence is still checked.
    if (seq(base).load(std::memory_order_acquire) != round) return false;
    const size_t n = lines_for(bytes);
    bool all = true;
    for (size_t l = 1; l < n; ++l) all &= seq(base + l * kLine).load(std::memory_order_acquire) == round;
    return all;
  }
  // After ready(q, round, bytes): rank q's data and signature.
  void read(int q, uint64_t round, void* out, size_t bytes) const {
    const char* base = lines(q, round);
    char* dst = static_cast<char*>(out);
    if (bytes) std::memcpy(dst, base + 8 + sizeof(CallSignature), std::min(kFirstData, bytes));
    size_t off = kFirstData;
    for (size_t l = 1; off < bytes; ++l, off += kNextData)
      std::memcpy(dst + off, base + l * kLine + 8, std::min(kNextData, bytes - off));
  }
  CallSignature signature(int q, uint64_t round) const {
    CallSignature c;
    std::memcpy(&c, lines(q, round) + 8, sizeof c);
    return c;
  }

 private:
  char* lines(int q, uint64_t round) const {
    return area_ + (static_cast<size_t>(q) * 2 + (round & 1u)) * kLines * kLine;
  }
  static std::atomic_ref<uint64_t> seq(const char* line) {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(const_cast<char*>(line)));
  }

  char* area_ = nullptr;
  int rank_ = 0;
};

}  // namespace cohort::shm
