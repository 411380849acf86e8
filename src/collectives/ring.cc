// Pipelined ring: the bandwidth-optimal algorithm for large vectors.
//
// The vector is cut into one block per rank and every block into chunks (COHORT_COLL_CHUNK). The
// reduce-scatter phase runs p-1 steps: at step s rank r sends block (r-s-1) to r+1 and receives
// block (r-s-2) from r-1, combining it with its own contribution; after the last step rank r
// holds block r fully reduced. The allgather phase runs p-1 steps passing finished blocks on.
// Each chunk is forwarded to the right as soon as it is reduced (or received), and receives are
// posted ahead of the data (see below), so sending, receiving and reducing overlap. With two ranks
// this is exactly "exchange halves, reduce, exchange back", pipelined by chunk.
#include <algorithm>
#include <cstring>
#include <memory>

#include "collectives/collectives.h"
#include "collectives/detail.h"
#include "collectives/reduce_kernels.h"
#include "collectives/select.h"

namespace cohort::coll::detail {

namespace {

struct RequestPool {
  std::vector<std::unique_ptr<std::vector<RequestId>>> lists;
  size_t depth = 0;
};
thread_local RequestPool t_request_pool;

}  // namespace

RequestList::RequestList() {
  auto& pool = t_request_pool;
  if (pool.depth == pool.lists.size()) pool.lists.push_back(std::make_unique<std::vector<RequestId>>());
  ids_ = pool.lists[pool.depth++].get();
  ids_->clear();
}

RequestList::~RequestList() {
  ids_->clear();
  --t_request_pool.depth;
}

void ring_engine(Context& ctx, const void* input, void* work, void* own_out, const Layout& layout, size_t esize,
                 DataType dtype, ReduceOp op, bool reduce, bool gather) {
  const int p = ctx.size();
  const int r = ctx.rank();
  if (p == 1 || (!reduce && !gather)) return;
  const int left = mod(r - 1, p), right = mod(r + 1, p);
  const size_t chunk_elems = std::max<size_t>(1, pipeline_chunk_bytes() / esize);
  const uint32_t nslots = static_cast<uint32_t>(std::max(1, pipeline_slots()));
  // Reduce-scatter chunks travel on slots [0, nslots), allgather chunks on [nslots, 2*nslots), so
  // the two phases' receives can be posted independently and still match in order.
  auto slot_of = [&](int s, size_t j) {
    return static_cast<uint32_t>(j % nslots) + (s < p - 1 ? 0u : nslots);
  };

  const int first_step = reduce ? 0 : p - 1;
  const int end_step = gather ? 2 * p - 2 : p - 1;
  auto recv_block = [&](int s) { return s < p - 1 ? mod(r - s - 2, p) : mod(r - (s - (p - 1)) - 1, p); };
  auto send_block = [&](int s) { return s < p - 1 ? mod(r - s - 1, p) : mod(r - (s - (p - 1)), p); };
  auto chunks_of = [&](int b) { return (layout.count(b) + chunk_elems - 1) / chunk_elems; };
  auto chunk_count = [&](int b, size_t j) { return std::min(chunk_elems, layout.count(b) - j * chunk_elems); };
  // Where block b's accumulated (or received) data lives on this rank.
  auto block_home = [&](int b) -> char* {
    if (b == r && own_out != nullptr) return static_cast<char*>(own_out);
    return bytes_at(work, layout.offset(b) * esize);
  };

  // Receives are posted before the data can arrive, so the transport lands every chunk straight in
  // its final place instead of buffering it as an unexpected message: all allgather receives
  // (straight into the output) at once, and the reduce-scatter receives of step s+2 as soon as
  // step s is done (two scratch regions of one block each, alternating by step parity).
  char* scratch = nullptr;
  size_t region = 0;
  if (reduce) {
    for (int b = 0; b < p; ++b) region = std::max(region, layout.count(b) * esize);
    const size_t regions = p - 1 >= 2 ? 2 : 1;
    if (region) scratch = static_cast<char*>(ctx.scratch(region * regions, 0));
  }
  RequestList rs_recvs, ag_recvs, sends;
  auto post_rs_step = [&](int s) {
    const int b = recv_block(s);
    char* base = scratch + static_cast<size_t>(s % 2) * region;
    for (size_t j = 0, n = chunks_of(b); j < n; ++j) {
      rs_recvs.push(ctx.irecv(left, base + j * chunk_elems * esize, chunk_count(b, j) * esize, slot_of(s, j)));
    }
  };
  if (reduce) {
    for (int s = 0; s < std::min(2, p - 1); ++s) post_rs_step(s);
  }
  if (gather) {
    for (int s = p - 1; s < end_step; ++s) {
      const int b = recv_block(s);
      for (size_t j = 0, n = chunks_of(b); j < n; ++j) {
        ag_recvs.push(ctx.irecv(left, block_home(b) + j * chunk_elems * esize, chunk_count(b, j) * esize,
                                slot_of(s, j)));
      }
    }
  }
  // The first step's chunks go out at once: for reduce-scatter they are this rank's own input.
  {
    const int b = send_block(first_step);
    const char* base = reduce ? bytes_at(input, layout.offset(b) * esize) : block_home(b);
    for (size_t j = 0, n = chunks_of(b); j < n; ++j) {
      sends.push(ctx.isend(right, base + j * chunk_elems * esize, chunk_count(b, j) * esize, slot_of(first_step, j)));
    }
  }

  size_t next_rs = 0, next_ag = 0;
  for (int s = first_step; s < end_step; ++s) {
    const int b = recv_block(s);
    const size_t n = chunks_of(b);
    for (size_t j = 0; j < n; ++j) {
      const size_t cnt = chunk_count(b, j);
      const size_t byte_off = j * chunk_elems * esize;
      char* home = block_home(b) + byte_off;
      if (s < p - 1) {
        ctx.wait(rs_recvs[next_rs++]);
        // Own contribution is the left operand, the partial from the left neighbour the right one.
        const char* mine = bytes_at(input, layout.offset(b) * esize + byte_off);
        kernels::reduce_to(home, mine, scratch + static_cast<size_t>(s % 2) * region + byte_off, cnt, dtype, op);
      } else {
        ctx.wait(ag_recvs[next_ag++]);
      }
      // Forward at once: the next step sends exactly the block this step received.
      if (s + 1 < end_step) sends.push(ctx.isend(right, home, cnt * esize, slot_of(s + 1, j)));
    }
    if (s < p - 1 && s + 2 < p - 1) post_rs_step(s + 2);
  }
  sends.wait_all(ctx);
}

}  // namespace cohort::coll::detail

namespace cohort::coll {

using detail::Layout;

void ring_allreduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  const size_t esize = dtype_size(dtype);
  detail::ring_engine(ctx, send, recv, nullptr, Layout::even(count, ctx.size()), esize, dtype, op, true, true);
}

}  // namespace cohort::coll
