// The allreduce family through the slots: small (every rank reduces everything), large (reduce-scatter
// then allgather, pipelined by chunk), on allocate_shared memory in place, and the fused parameter update.
#include "collectives/shm/group.h"
#include "collectives/shm/group_internal.h"

#include <sched.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cohort/error.h"
#include "collectives/reduce_kernels.h"
#include "common/affinity.h"
#include "common/copy.h"
#include "common/env.h"
#include "common/log.h"

namespace cohort::shm {

void Group::allreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op) {
  if (!op_supported(dtype, op))
    throw InvalidArgument(fmt::format("allreduce: op {} is not defined for dtype {}", reduce_op_name(op),
                                      dtype_name(dtype)));
  const size_t bytes = count * dtype_size(dtype);
  std::shared_ptr<SharedRegion> shared;
  size_t offset = 0;
  if (size_ > 1 && in == out && bytes > options_.small_bytes) shared = find_shared(out, bytes, &offset);
  guarded(
      "allreduce",
      [&] {
        if (size_ == 1) {
          if (in != out && bytes) std::memmove(out, in, bytes);  // 0 bytes may come with null pointers
          return;
        }
        if (shared) {
          allreduce_shared(*shared, offset, count, dtype, op);
        } else if (bytes <= options_.small_bytes && inline_for(bytes)) {
          allreduce_inline(in, out, count, dtype, op);
        } else if (bytes <= options_.small_bytes) {
          allreduce_small(in, out, count, dtype, op);
        } else {
          const auto start = std::chrono::steady_clock::now();
          allreduce_large(in, out, count, dtype, op);
          if (bytes >= chunk_.bytes) after_large_allreduce(bytes, std::chrono::steady_clock::now() - start);
        }
      },
      shared ? shared_tag(shared->id, offset) : 0);
}

void Group::allreduce_small(const void* in, void* out, size_t count, DataType dtype, ReduceOp op) {
  const size_t bytes = count * dtype_size(dtype);
  const unsigned p = next_parity();
  if (bytes) std::memcpy(slot(rank_, p), in, bytes);  // a 0-element call may pass null (found by UBSan)
  sync_.post();
  wait_all("allreduce");
  kernels::reduce_to(out, slot(0, p), slot(1, p), count, dtype, op);
  for (int q = 2; q < size_; ++q) kernels::reduce_into(out, slot(q, p), count, dtype, op);
  if (op == ReduceOp::kAvg) kernels::finish_average(out, count, dtype, size_);
}

void Group::allreduce_large(const void* in_v, void* out_v, size_t count, DataType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const char* in = static_cast<const char*>(in_v);
  char* out = static_cast<char*>(out_v);
  const size_t chunk_elems = chunk_.bytes / es;
  for (size_t off = 0; off < count; off += chunk_elems) {
    const size_t c = std::min(chunk_elems, count - off);
    const Slices sl(c, size_, es);
    const unsigned p = next_parity();
    char* mine = slot(rank_, p);
    // Phase 1: stage the slices the peers own.
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && sl.length(q) > 0)
        write_slot(mine + sl.begin(q) * es, in + (off + sl.begin(q)) * es, sl.length(q) * es);
    sync_.post();
    wait_all("allreduce");
    // Phase 2: reduce my slice into my slot (rank order), reading my input and the peers' slots.
    const size_t b = sl.begin(rank_), n = sl.length(rank_);
    if (n > 0) {
      auto source = [&](int q) -> const char* {
        return q == rank_ ? in + (off + b) * es : slot(q, p) + b * es;
      };
      // Cached: reduce in the slot, where the peers read it from this cache, then copy to the output.
      // Streaming: reduce in the output and stream the result to the slot. In place, the output is my
      // input: ranks 0 and 1 may overwrite it (reduce_to reads both inputs first), a higher rank's
      // input is read after the first step, so it accumulates aside.
      const bool streaming = slot_copy() == SlotCopy::kStreaming;
      char* acc = mine + b * es;
      if (streaming) {
        acc = out + (off + b) * es;
        if (rank_ >= 2 && in == out) {
          if (aside_.size() < n * es) aside_.resize(n * es);
          acc = aside_.data();
        }
      }
      kernels::reduce_to(acc, source(0), source(1), n, dtype, op);
      for (int q = 2; q < size_; ++q) kernels::reduce_into(acc, source(q), n, dtype, op);
      if (op == ReduceOp::kAvg) kernels::finish_average(acc, n, dtype, size_);
      if (streaming) copy::copy_streaming(mine + b * es, acc, n * es);
      if (acc != out + (off + b) * es) std::memcpy(out + (off + b) * es, acc, n * es);
    }
    sync_.post();
    wait_all("allreduce");
    // Phase 3: collect the other slices' results from their owners' slots.
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && sl.length(q) > 0)
        std::memcpy(out + (off + sl.begin(q)) * es, slot(q, p) + sl.begin(q) * es, sl.length(q) * es);
  }
}

std::shared_ptr<void> Group::allreduce_shareable(void* buf, size_t count, DataType dtype, ReduceOp op,
                                                bool want_shared) {
  if (!op_supported(dtype, op))
    throw InvalidArgument(fmt::format("allreduce: op {} is not defined for dtype {}", reduce_op_name(op),
                                      dtype_name(dtype)));
  const size_t bytes = count * dtype_size(dtype);
  // Equal on every rank (the count and dtype are compared): only such calls can run in place, so only
  // they ask for memory.
  const bool large = size_ > 1 && bytes > options_.small_bytes;
  std::shared_ptr<SharedRegion> shared;
  size_t offset = 0;
  if (large) shared = find_shared(buf, bytes, &offset);
  std::shared_ptr<void> memory;
  guarded(
      "allreduce",
      [&] {
        if (size_ == 1) return;
        if (!large) return allreduce_small(buf, buf, count, dtype, op);
        // The in-place path's first round, on every rank: afterwards every buffer holds its
        // contribution, and the signatures (compared and tallied here) say which path all ranks take.
        sync_.post();
        wait_all("allreduce");
        if (shared && tally_.same_shared_range) return reduce_shared(*shared, offset, count, dtype, op);
        const auto start = std::chrono::steady_clock::now();
        allreduce_large(buf, buf, count, dtype, op);
        if (bytes >= chunk_.bytes) after_large_allreduce(bytes, std::chrono::steady_clock::now() - start);
        if (tally_.all_want_shared) memory = allocate_shared(bytes);
      },
      shared ? shared_tag(shared->id, offset) : 0, /*tally=*/true, want_shared && large ? kCallWantsShared : 0);
  return memory;
}

void Group::allreduce_shared(const SharedRegion& region, size_t offset, size_t count, DataType dtype, ReduceOp op) {
  // Round 1: every rank's buffer holds its contribution (and the signatures are compared).
  sync_.post();
  wait_all("allreduce");
  reduce_shared(region, offset, count, dtype, op);
}

void Group::reduce_shared(const SharedRegion& region, size_t offset, size_t count, DataType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const Slices sl(count, size_, es);
  auto at = [&](int q, size_t element) { return region.part(q) + offset + element * es; };
  // Reduce my slice from every rank's buffer, in rank order, a piece small enough to stay in this
  // core's cache at a time, and write each piece's result into every peer's buffer while it is hot.
  // Peers touch other slices only, and no rank changes its buffer before the second round.
  const size_t b = sl.begin(rank_), n = sl.length(rank_);
  const size_t piece = std::max<size_t>(kLine, (size_t{64} << 10) / es);
  // Ranks 0 and 1 accumulate in their own buffer (reduce_to may write over one of its inputs); a
  // higher rank's own contribution is read after that first step, so it accumulates aside.
  if (rank_ >= 2 && aside_.size() < piece * es) aside_.resize(piece * es);
  for (size_t i = 0; i < n; i += piece) {
    const size_t m = std::min(piece, n - i);
    char* acc = rank_ < 2 ? at(rank_, b + i) : aside_.data();
    kernels::reduce_to(acc, at(0, b + i), at(1, b + i), m, dtype, op);
    for (int q = 2; q < size_; ++q) kernels::reduce_into(acc, at(q, b + i), m, dtype, op);
    if (op == ReduceOp::kAvg) kernels::finish_average(acc, m, dtype, size_);
    for (int q = 0; q < size_; ++q)
      if (acc != at(q, b + i)) std::memcpy(at(q, b + i), acc, m * es);
  }
  // Round 2: every slice is final in every buffer; no peer reads or writes mine after this.
  sync_.post();
  wait_all("allreduce");
  ++shared_allreduces_;
}

bool Group::allreduce_update(float* grads, float* params, size_t count, ReduceOp op, const ParameterUpdate& update) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg)
    throw InvalidArgument(fmt::format("allreduce_update: op {} (sum or avg only)", reduce_op_name(op)));
  const size_t es = sizeof(float), bytes = count * es;
  size_t grads_offset = 0, params_offset = 0;
  std::shared_ptr<SharedRegion> g, w;
  if (size_ > 1 && count > 0) {
    g = find_shared(grads, bytes, &grads_offset);
    w = find_shared(params, bytes, &params_offset);
  }
  if (size_ > 1 && (!g || !w)) return false;
  // Both ranges in the signature: a peer that passes other ranges (or ordinary memory) mismatches.
  const uint32_t tag =
      g ? ((shared_tag(g->id, grads_offset) * 0x01000193u) ^ shared_tag(w->id, params_offset)) | 1u : 0;
  guarded(
      "allreduce",
      [&] {
        if (size_ == 1) {
          if (count > 0) update(0, count, grads, params);
          return;
        }
        auto grad_at = [&](int q, size_t i) {
          return reinterpret_cast<const float*>(g->part(q) + grads_offset) + i;
        };
        auto param_at = [&](int q, size_t i) { return reinterpret_cast<float*>(w->part(q) + params_offset) + i; };
        // Round 1: every rank's gradients are final, and no rank reads its parameters until round 2
        // (peers write into them in between).
        sync_.post();
        wait_all("allreduce");
        // My slice, a piece at a time: the reduced gradients stay in this core's cache for the update,
        // and the updated piece for the copies into the peers' parameters.
        const Slices sl(count, size_, es);
        const size_t b = sl.begin(rank_), n = sl.length(rank_);
        const size_t piece = (size_t{32} << 10) / es;
        if (aside_.size() < piece * es) aside_.resize(piece * es);
        float* reduced = reinterpret_cast<float*>(aside_.data());
        for (size_t i = 0; i < n; i += piece) {
          const size_t m = std::min(piece, n - i);
          kernels::reduce_to(reduced, grad_at(0, b + i), grad_at(1, b + i), m, DataType::kFloat32, op);
          for (int q = 2; q < size_; ++q) kernels::reduce_into(reduced, grad_at(q, b + i), m, DataType::kFloat32, op);
          if (op == ReduceOp::kAvg) kernels::finish_average(reduced, m, DataType::kFloat32, size_);
          float* mine = param_at(rank_, b + i);
          update(b + i, m, reduced, mine);
          for (int q = 0; q < size_; ++q)
            if (q != rank_) std::memcpy(param_at(q, b + i), mine, m * es);
        }
        // Round 2: every slice of every rank's parameters is updated; nobody touches a peer's after it.
        sync_.post();
        wait_all("allreduce");
        ++fused_updates_;
      },
      tag);
  return true;
}

}  // namespace cohort::shm
