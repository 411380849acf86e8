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
#include "common/env.h"

namespace cohort::coll::detail {

namespace {

struct RequestPool {
  std::vector<std::unique_ptr<std::vector<RequestId>>> lists;
  size_t depth = 0;
};
thread_local RequestPool t_request_pool;

const env::IntSetting kRsWindow(
    "COHORT_COLL_RS_WINDOW", 1,
    "reduce-scatter receive window of the ring in chunks (0: one scratch region per block, all chunks of two "
    "steps posted ahead). With W > 0 the partials land in W chunk-sized scratch buffers that stay in cache, and "
    "the first step's sends are paced to that window (must be equal on all ranks, like COHORT_COLL_CHUNK)");
// Why a small window is the default: with one block-sized scratch region the kernel writes each
// received partial to memory that is out of cache by the time the reduce reads it (at 64 MiB the
// vector plus a 32 MiB region exceed the 32 MiB L3 here); a one-chunk buffer is still in L2. On 2
// ranks over loopback TCP, 64 MiB, interleaved runs on a loaded machine (docs/perf-comm.md): W=1
// beat W=0 in 5 of 6 pairs (up to 2.55 vs 1.68 GB/s busbw) and W=2 in 6 of 6, although it lets more
// chunks arrive before their receive is posted (those are buffered and copied once).

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
  const size_t chunk_bytes = chunk_elems * esize;
  const size_t window = reduce ? static_cast<size_t>(std::max<int64_t>(0, kRsWindow.get())) : 0;
  // Windowed mode: the reduce-scatter receives in order (step, chunk), the k-th into buffer k % window.
  struct RsChunk {
    int step;
    size_t chunk;
  };
  std::vector<RsChunk> rs_seq;
  size_t rs_posted = 0;
  if (reduce && window > 0) {
    for (int s = 0; s < p - 1; ++s)
      for (size_t j = 0, n = chunks_of(recv_block(s)); j < n; ++j) rs_seq.push_back({s, j});
    scratch = static_cast<char*>(ctx.scratch(window * chunk_bytes, 0));
  } else if (reduce) {
    for (int b = 0; b < p; ++b) region = std::max(region, layout.count(b) * esize);
    const size_t regions = p - 1 >= 2 ? 2 : 1;
    if (region) scratch = static_cast<char*>(ctx.scratch(region * regions, 0));
  }
  // Reduce-scatter chunks travel on slots [0, nslots), allgather chunks on [nslots, 2*nslots), so
  // the two phases' receives can be posted independently and still match in order. In windowed mode
  // the first step's paced sends interleave with the forwards of later steps, so they get slots of
  // their own: [2*nslots, 3*nslots).
  auto slot_of = [&](int s, size_t j) {
    if (window > 0 && s == 0) return static_cast<uint32_t>(j % nslots) + 2 * nslots;
    return static_cast<uint32_t>(j % nslots) + (s < p - 1 ? 0u : nslots);
  };
  RequestList rs_recvs, ag_recvs, sends;
  auto post_rs_next = [&] {
    const RsChunk& c = rs_seq[rs_posted];
    char* buf = scratch + (rs_posted % window) * chunk_bytes;
    rs_recvs.push(ctx.irecv(left, buf, chunk_count(recv_block(c.step), c.chunk) * esize, slot_of(c.step, c.chunk)));
    ++rs_posted;
  };
  auto post_rs_step = [&](int s) {
    const int b = recv_block(s);
    char* base = scratch + static_cast<size_t>(s % 2) * region;
    for (size_t j = 0, n = chunks_of(b); j < n; ++j) {
      rs_recvs.push(ctx.irecv(left, base + j * chunk_elems * esize, chunk_count(b, j) * esize, slot_of(s, j)));
    }
  };
  if (reduce && window > 0) {
    while (rs_posted < std::min(window, rs_seq.size())) post_rs_next();
  } else if (reduce) {
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
  // In windowed mode only `window` of them at first, then one per reduced chunk, so that they do not
  // run ahead of the receiver's window (they would be buffered and copied as early arrivals).
  const int first_block = send_block(first_step);
  const char* first_base = reduce ? bytes_at(input, layout.offset(first_block) * esize) : block_home(first_block);
  const size_t first_chunks = chunks_of(first_block);
  size_t first_sent = 0;
  auto send_first = [&](size_t upto) {
    for (; first_sent < std::min(upto, first_chunks); ++first_sent) {
      sends.push(ctx.isend(right, first_base + first_sent * chunk_bytes, chunk_count(first_block, first_sent) * esize,
                           slot_of(first_step, first_sent)));
    }
  };
  send_first(window > 0 ? window : first_chunks);

  size_t next_rs = 0, next_ag = 0;
  for (int s = first_step; s < end_step; ++s) {
    const int b = recv_block(s);
    const size_t n = chunks_of(b);
    for (size_t j = 0; j < n; ++j) {
      const size_t cnt = chunk_count(b, j);
      const size_t byte_off = j * chunk_elems * esize;
      char* home = block_home(b) + byte_off;
      if (s < p - 1) {
        const size_t k = next_rs;
        ctx.wait(rs_recvs[next_rs++]);
        // Own contribution is the left operand, the partial from the left neighbour the right one.
        const char* mine = bytes_at(input, layout.offset(b) * esize + byte_off);
        const char* partial = window > 0 ? scratch + (k % window) * chunk_bytes
                                         : scratch + static_cast<size_t>(s % 2) * region + byte_off;
        kernels::reduce_to(home, mine, partial, cnt, dtype, op);
        if (window > 0) {
          if (rs_posted < rs_seq.size()) post_rs_next();  // its buffer is free again
          send_first(window + k + 1);
        }
      } else {
        ctx.wait(ag_recvs[next_ag++]);
      }
      // Forward at once: the next step sends exactly the block this step received.
      if (s + 1 < end_step) sends.push(ctx.isend(right, home, cnt * esize, slot_of(s + 1, j)));
    }
    if (window == 0 && s < p - 1 && s + 2 < p - 1) post_rs_step(s + 2);
    if (s == p - 2) send_first(first_chunks);  // blocks of uneven chunk counts: the rest goes now
  }
  send_first(first_chunks);
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
