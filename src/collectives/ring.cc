// Pipelined ring: the bandwidth-optimal algorithm for large vectors.
//
// The vector is cut into one block per rank and every block into chunks (COHORT_COLL_CHUNK). The
// reduce-scatter phase runs p-1 steps: at step s rank r sends block (r-s-1) to r+1 and receives
// block (r-s-2) from r-1, combining it with its own contribution; after the last step rank r
// holds block r fully reduced. The allgather phase runs p-1 steps passing finished blocks on.
// All (step, chunk) items of both phases form one sequence: each item's chunk is forwarded to the
// right as soon as it is reduced (or received), and up to COHORT_COLL_WINDOW receives are posted
// ahead into a ring of scratch chunks, so sending, receiving and reducing overlap. With two ranks
// this is exactly "exchange halves, reduce, exchange back", pipelined by chunk.
#include <algorithm>
#include <array>
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

namespace {

constexpr int kMaxWindow = 64;

// Position in the flattened (step, chunk) sequence.
struct Cursor {
  int step;
  size_t chunk;
};

}  // namespace

void ring_engine(Context& ctx, const void* input, void* work, void* own_out, const Layout& layout, size_t esize,
                 DataType dtype, ReduceOp op, bool reduce, bool gather) {
  const int p = ctx.size();
  const int r = ctx.rank();
  if (p == 1 || (!reduce && !gather)) return;
  const int left = mod(r - 1, p), right = mod(r + 1, p);
  const size_t chunk_elems = std::max<size_t>(1, pipeline_chunk_bytes() / esize);
  const int window = std::clamp(pipeline_window(), 1, kMaxWindow);
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

  // Reduce-scatter receives into `window` scratch slots, each as large as the largest chunk.
  char* scratch = nullptr;
  size_t slot_stride = 0;
  if (reduce) {
    for (int b = 0; b < p; ++b) slot_stride = std::max(slot_stride, std::min(layout.count(b), chunk_elems) * esize);
    if (slot_stride) scratch = static_cast<char*>(ctx.scratch(slot_stride * static_cast<size_t>(window), 0));
  }

  RequestList sends;
  // The first step's chunks go out at once: for reduce-scatter they are this rank's own input.
  {
    int b = send_block(first_step);
    const char* base = reduce ? bytes_at(input, layout.offset(b) * esize) : block_home(b);
    for (size_t j = 0, n = chunks_of(b); j < n; ++j) {
      sends.push(ctx.isend(right, base + j * chunk_elems * esize, chunk_count(b, j) * esize,
                           static_cast<uint32_t>(j % nslots)));
    }
  }

  auto advance = [&](Cursor& c) {
    ++c.chunk;
    while (c.step < end_step && c.chunk >= chunks_of(recv_block(c.step))) {
      ++c.step;
      c.chunk = 0;
    }
  };
  auto normalize = [&](Cursor& c) {
    while (c.step < end_step && c.chunk >= chunks_of(recv_block(c.step))) {
      ++c.step;
      c.chunk = 0;
    }
  };

  std::array<RequestId, kMaxWindow> pending{};
  Cursor post{first_step, 0};
  normalize(post);
  size_t posted = 0;
  auto post_recv = [&]() {
    int b = recv_block(post.step);
    size_t n = chunk_count(b, post.chunk);
    void* dst = post.step < p - 1 ? static_cast<void*>(scratch + (posted % window) * slot_stride)
                                  : static_cast<void*>(block_home(b) + post.chunk * chunk_elems * esize);
    pending[posted % window] = ctx.irecv(left, dst, n * esize, static_cast<uint32_t>(post.chunk % nslots));
    ++posted;
    advance(post);
  };
  while (post.step < end_step && posted < static_cast<size_t>(window)) post_recv();

  Cursor cur{first_step, 0};
  normalize(cur);
  for (size_t k = 0; cur.step < end_step; ++k) {
    ctx.wait(pending[k % window]);
    const int b = recv_block(cur.step);
    const size_t n = chunk_count(b, cur.chunk);
    const size_t byte_off = cur.chunk * chunk_elems * esize;
    char* home = block_home(b) + byte_off;
    if (cur.step < p - 1) {
      // Combine own contribution (left operand) with the partial from the left neighbour.
      const char* mine = bytes_at(input, layout.offset(b) * esize + byte_off);
      kernels::reduce_to(home, mine, scratch + (k % window) * slot_stride, n, dtype, op);
    }
    if (cur.step + 1 < end_step) {
      sends.push(ctx.isend(right, home, n * esize, static_cast<uint32_t>(cur.chunk % nslots)));
    }
    if (post.step < end_step) post_recv();
    advance(cur);
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
