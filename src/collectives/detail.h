#pragma once
// Internal helpers shared by the algorithm files (not part of the collectives' interface).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cohort/types.h"
#include "collectives/context.h"

namespace cohort::coll::detail {

inline char* bytes_at(void* p, size_t offset) { return static_cast<char*>(p) + offset; }
inline const char* bytes_at(const void* p, size_t offset) { return static_cast<const char*>(p) + offset; }

// How a vector is cut into one block per rank, in elements. Either an even split of `total`
// (block b gets total/p elements, plus one for b < total%p), a fixed `stride` per block, or
// explicit counts (displacements are the prefix sums).
struct Layout {
  int parts = 1;
  size_t total = 0;           // even split
  size_t stride = 0;          // fixed-size blocks when non-zero
  const size_t* counts = nullptr;
  const size_t* displs = nullptr;  // with counts

  static Layout even(size_t total, int parts) {
    Layout l;
    l.parts = parts;
    l.total = total;
    return l;
  }
  static Layout fixed(size_t per_block, int parts) {
    Layout l;
    l.parts = parts;
    l.stride = per_block;
    l.total = per_block * static_cast<size_t>(parts);
    return l;
  }
  static Layout variable(const size_t* counts, const size_t* displs, int parts) {
    Layout l;
    l.parts = parts;
    l.counts = counts;
    l.displs = displs;
    return l;
  }
  size_t count(int b) const {
    if (counts) return counts[b];
    if (stride) return stride;
    size_t base = total / static_cast<size_t>(parts), rem = total % static_cast<size_t>(parts);
    return base + (static_cast<size_t>(b) < rem ? 1 : 0);
  }
  size_t offset(int b) const {
    if (counts) return displs[b];
    if (stride) return stride * static_cast<size_t>(b);
    size_t base = total / static_cast<size_t>(parts), rem = total % static_cast<size_t>(parts);
    size_t ub = static_cast<size_t>(b);
    return ub * base + (ub < rem ? ub : rem);
  }
  // Elements in blocks [first, first + n) (contiguous blocks, first + n <= parts).
  size_t span_count(int first, int n) const {
    if (n <= 0) return 0;
    return offset(first + n - 1) + count(first + n - 1) - offset(first);
  }
};

inline int mod(int a, int p) { return ((a % p) + p) % p; }

// Largest power of two <= n (n >= 1).
inline int pow2_floor(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

// A per-thread list of request ids reused across calls, so the hot path does not allocate once
// it has grown. Each algorithm takes one at entry; nesting (an algorithm calling another) uses
// the next one.
class RequestList {
 public:
  RequestList();
  ~RequestList();
  RequestList(const RequestList&) = delete;
  RequestList& operator=(const RequestList&) = delete;
  void push(RequestId id) { ids_->push_back(id); }
  size_t size() const { return ids_->size(); }
  RequestId operator[](size_t i) const { return (*ids_)[i]; }
  void wait_all(Context& ctx) {
    if (!ids_->empty()) ctx.wait_all(std::span<const RequestId>(ids_->data(), ids_->size()));
    ids_->clear();
  }

 private:
  std::vector<RequestId>* ids_;
};

// Exchange helpers: post receive first, then send, then wait both.
inline void sendrecv(Context& ctx, int send_peer, const void* send, size_t send_bytes, int recv_peer, void* recv,
                     size_t recv_bytes, uint32_t slot = 0) {
  RequestId ids[2];
  int n = 0;
  if (recv_bytes) ids[n++] = ctx.irecv(recv_peer, recv, recv_bytes, slot);
  if (send_bytes) ids[n++] = ctx.isend(send_peer, send, send_bytes, slot);
  if (n) ctx.wait_all(std::span<const RequestId>(ids, static_cast<size_t>(n)));
}

// ---- building blocks implemented in ring.cc ----

// Pipelined ring over `layout` (one block per rank, element size `esize`):
//   reduce-scatter phase (when `reduce`): after it, rank r holds block r fully reduced;
//   allgather phase (when `gather`): afterwards every rank holds every block.
// Reduce-scatter reads rank r's own contribution of block b from `input` + offset(b) and writes
// the partial sums to `work` + offset(b); block r's final value goes to `own_out` (or work when
// null). The allgather phase sends from / receives into `work` (block r must be there or in
// own_out == work + offset(r)). `input` may equal `work`.
void ring_engine(Context& ctx, const void* input, void* work, void* own_out, const Layout& layout, size_t esize,
                 DataType dtype, ReduceOp op, bool reduce, bool gather);

}  // namespace cohort::coll::detail
