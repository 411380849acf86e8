// Rooted operations: broadcast (binomial tree, pipelined by chunk; scatter + ring allgather for
// large vectors) and reduce (binomial tree; ring reduce-scatter + gather for large vectors).
//
// Binomial trees use ranks relative to the root, vr = (r - root) mod p: the parent of vr is vr with
// its lowest set bit cleared, its children are vr + 2^k for 2^k below that bit.
#include <algorithm>
#include <cstring>

#include "collectives/collectives.h"
#include "collectives/detail.h"
#include "collectives/reduce_kernels.h"
#include "collectives/select.h"

namespace cohort::coll {

namespace {

using detail::bytes_at;
using detail::Layout;
using detail::mod;

void binomial_broadcast(Context& ctx, void* buf, size_t bytes, int root) {
  const int p = ctx.size();
  const int vr = mod(ctx.rank() - root, p);
  int parent = -1;
  int mask = 1;
  while (mask < p) {
    if (vr & mask) {
      parent = mod(vr - mask + root, p);
      break;
    }
    mask <<= 1;
  }
  // Children: vr + m for m = mask/2, mask/4, ... (farthest first, so the deepest subtree starts first).
  int children[32];
  int nchildren = 0;
  for (int m = mask >> 1; m > 0; m >>= 1) {
    if (vr + m < p) children[nchildren++] = mod(vr + m + root, p);
  }
  // Chunks are received in order and forwarded as each arrives, so the tree is pipelined.
  const size_t chunk = std::max<size_t>(1, pipeline_chunk_bytes());
  const size_t nchunks = (bytes + chunk - 1) / chunk;
  detail::RequestList recvs;
  detail::RequestList sends;
  if (parent >= 0) {
    for (size_t j = 0; j < nchunks; ++j) {
      recvs.push(ctx.irecv(parent, bytes_at(buf, j * chunk), std::min(chunk, bytes - j * chunk)));
    }
  }
  for (size_t j = 0; j < nchunks; ++j) {
    if (parent >= 0) ctx.wait(recvs[j]);
    for (int c = 0; c < nchildren; ++c) {
      sends.push(ctx.isend(children[c], bytes_at(buf, j * chunk), std::min(chunk, bytes - j * chunk)));
    }
  }
  sends.wait_all(ctx);
}

// Root sends block b to rank b, then a ring allgather completes the vector everywhere.
void scatter_allgather_broadcast(Context& ctx, void* buf, size_t count, DataType dtype, int root) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t esize = dtype_size(dtype);
  const Layout layout = Layout::even(count, p);
  if (r == root) {
    detail::RequestList sends;
    for (int b = 0; b < p; ++b) {
      if (b == root || layout.count(b) == 0) continue;
      sends.push(ctx.isend(b, bytes_at(buf, layout.offset(b) * esize), layout.count(b) * esize));
    }
    sends.wait_all(ctx);
  } else if (layout.count(r) > 0) {
    ctx.wait(ctx.irecv(root, bytes_at(buf, layout.offset(r) * esize), layout.count(r) * esize));
  }
  detail::ring_engine(ctx, buf, buf, nullptr, layout, esize, dtype, ReduceOp::kSum, false, true);
}

void binomial_reduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                     int root) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const int vr = mod(r - root, p);
  const size_t bytes = count * dtype_size(dtype);
  // The accumulator is recv at the root and scratch elsewhere; `src` is this rank's partial so far.
  void* acc = r == root ? recv : ctx.scratch(bytes, 1);
  void* tmp = ctx.scratch(bytes, 2);
  const void* src = send;
  for (int mask = 1; mask < p; mask <<= 1) {
    if (vr & mask) {
      ctx.wait(ctx.isend(mod(vr - mask + root, p), src, bytes));
      return;
    }
    if (vr + mask < p) {
      ctx.wait(ctx.irecv(mod(vr + mask + root, p), tmp, bytes));
      // This rank covers the lower-numbered ranks, so its operand goes first.
      kernels::reduce_to(acc, src, tmp, count, dtype, op);
      src = acc;
    }
  }
  if (src != recv) std::memcpy(recv, src, bytes);
}

// Ring reduce-scatter into scratch, then every rank sends its finished block to the root.
void ring_reduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t esize = dtype_size(dtype);
  const Layout layout = Layout::even(count, p);
  void* work = ctx.scratch(count * esize, 1);
  detail::ring_engine(ctx, send, work, nullptr, layout, esize, dtype, op, true, false);
  if (r != root) {
    if (layout.count(r)) ctx.wait(ctx.isend(root, bytes_at(work, layout.offset(r) * esize), layout.count(r) * esize));
    return;
  }
  detail::RequestList recvs;
  for (int b = 0; b < p; ++b) {
    if (b == root || layout.count(b) == 0) continue;
    recvs.push(ctx.irecv(b, bytes_at(recv, layout.offset(b) * esize), layout.count(b) * esize));
  }
  std::memcpy(bytes_at(recv, layout.offset(r) * esize), bytes_at(work, layout.offset(r) * esize),
              layout.count(r) * esize);
  recvs.wait_all(ctx);
}

}  // namespace

void broadcast(Context& ctx, void* buf, size_t count, DataType dtype, int root, Algorithm algo) {
  const int p = ctx.size();
  const size_t bytes = count * dtype_size(dtype);
  if (count == 0 || p == 1) return;
  if (select_algorithm(OpKind::kBroadcast, p, bytes, algo) == Algorithm::kScatterAllgather) {
    scatter_allgather_broadcast(ctx, buf, count, dtype, root);
  } else {
    binomial_broadcast(ctx, buf, bytes, root);
  }
}

void reduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root,
            Algorithm algo) {
  const int p = ctx.size();
  const size_t bytes = count * dtype_size(dtype);
  if (count == 0) return;
  if (p == 1) {
    if (send != recv) std::memcpy(recv, send, bytes);
    return;
  }
  if (select_algorithm(OpKind::kReduce, p, bytes, algo) == Algorithm::kRing) {
    ring_reduce(ctx, send, recv, count, dtype, op, root);
  } else {
    binomial_reduce(ctx, send, recv, count, dtype, op, root);
  }
  if (op == ReduceOp::kAvg && ctx.rank() == root) kernels::finish_average(recv, count, dtype, p);
}

}  // namespace cohort::coll
