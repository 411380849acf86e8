// Data-movement collectives without reduction: allgather (ring, Bruck), allgatherv (ring),
// gather/scatter (linear), alltoall/alltoallv (pairwise, overlapped) and the dissemination barrier.
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/detail.h"
#include "collectives/select.h"

namespace cohort::coll {

namespace {

using detail::bytes_at;
using detail::Layout;
using detail::mod;

// Bruck: after step k, tmp holds the blocks of ranks r .. r + 2^(k+1) - 1 (mod p) in that order;
// each step sends the first min(2^k, p - 2^k) blocks to r - 2^k and receives as many from r + 2^k.
void bruck_allgather(Context& ctx, const void* own, void* recv, size_t block_bytes) {
  const int p = ctx.size();
  const int r = ctx.rank();
  char* tmp = static_cast<char*>(ctx.scratch(block_bytes * static_cast<size_t>(p), 1));
  std::memcpy(tmp, own, block_bytes);
  for (int dist = 1; dist < p; dist <<= 1) {
    const size_t n = static_cast<size_t>(std::min(dist, p - dist));
    detail::sendrecv(ctx, mod(r - dist, p), tmp, n * block_bytes, mod(r + dist, p),
                     tmp + static_cast<size_t>(dist) * block_bytes, n * block_bytes);
  }
  for (int i = 0; i < p; ++i) {
    const int b = mod(r + i, p);
    if (b == r && bytes_at(recv, static_cast<size_t>(r) * block_bytes) == own) continue;
    std::memcpy(bytes_at(recv, static_cast<size_t>(b) * block_bytes), tmp + static_cast<size_t>(i) * block_bytes,
                block_bytes);
  }
}

thread_local std::vector<size_t> t_displs;

// Pairwise exchange, overlapped: every receive is posted first, then the sends go out in pairwise order
// (to r+1, r+2, ...: at any moment the ranks send to different partners), with at most
// kExchangeWindow of them unfinished at a time. One partner pair per step, each step waiting for its
// slowest pair, left links idle between the steps: across 4 hosts x 2 ranks on 1 Gbit/s links the
// stepped exchange moved 62 % of the link's rate at 64 MiB where gloo, which posts everything at once,
// moved 71 % (bench/multihost_coll.sh). The window keeps the links busy without every rank sending to
// every other at once on a large job. block(peer) gives {send pointer, send bytes, recv pointer,
// recv bytes} for that peer; a zero-byte side is not posted (both ends agree on the sizes).
constexpr int kExchangeWindow = 8;

struct ExchangeBlock {
  const void* send;
  size_t send_bytes;
  void* recv;
  size_t recv_bytes;
};

template <typename BlockOf>
void pairwise_exchange(Context& ctx, BlockOf block) {
  const int p = ctx.size();
  const int r = ctx.rank();
  detail::RequestList recvs, sends;
  for (int k = 1; k < p; ++k) {
    const int from = mod(r - k, p);
    const ExchangeBlock b = block(from);
    if (b.recv_bytes) recvs.push(ctx.irecv(from, b.recv, b.recv_bytes));
  }
  size_t oldest = 0;  // sends[oldest..] may be unfinished
  for (int k = 1; k < p; ++k) {
    const int to = mod(r + k, p);
    const ExchangeBlock b = block(to);
    if (!b.send_bytes) continue;
    if (sends.size() - oldest >= static_cast<size_t>(kExchangeWindow)) ctx.wait(sends[oldest++]);
    sends.push(ctx.isend(to, b.send, b.send_bytes));
  }
  for (size_t i = oldest; i < sends.size(); ++i) ctx.wait(sends[i]);
  recvs.wait_all(ctx);
}
}  // namespace

void allgather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, Algorithm algo) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t esize = dtype_size(dtype);
  const size_t block_bytes = count * esize;
  if (count == 0) return;
  char* own = static_cast<char*>(recv) + static_cast<size_t>(r) * block_bytes;
  const bool in_place = send == recv;
  const void* own_input = in_place ? own : send;
  if (p > 1 && select_algorithm(OpKind::kAllgather, p, block_bytes * static_cast<size_t>(p), algo) ==
                   Algorithm::kBruck) {
    bruck_allgather(ctx, own_input, recv, block_bytes);
    return;
  }
  if (!in_place) std::memcpy(own, send, block_bytes);
  detail::ring_engine(ctx, recv, recv, nullptr, Layout::fixed(count, p), esize, dtype, ReduceOp::kSum, false, true);
}

void allgatherv(Context& ctx, const void* send, size_t send_count, void* recv, const size_t* recv_counts,
                DataType dtype, Algorithm algo) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t esize = dtype_size(dtype);
  auto& displs = t_displs;
  displs.resize(static_cast<size_t>(p));
  size_t total = 0;
  for (int b = 0; b < p; ++b) {
    displs[static_cast<size_t>(b)] = total;
    total += recv_counts[b];
  }
  select_algorithm(OpKind::kAllgatherv, p, total * esize, algo);  // validates a forced choice
  char* own = static_cast<char*>(recv) + displs[static_cast<size_t>(r)] * esize;
  if (send != recv && send_count) std::memcpy(own, send, send_count * esize);
  if (total == 0) return;
  const Layout layout = Layout::variable(recv_counts, displs.data(), p);
  detail::ring_engine(ctx, recv, recv, nullptr, layout, esize, dtype, ReduceOp::kSum, false, true);
}

void gather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, int root, Algorithm algo) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t block_bytes = count * dtype_size(dtype);
  if (count == 0) return;
  select_algorithm(OpKind::kGather, p, block_bytes * static_cast<size_t>(p), algo);
  if (r != root) {
    ctx.wait(ctx.isend(root, send, block_bytes));
    return;
  }
  detail::RequestList recvs;
  for (int b = 0; b < p; ++b) {
    if (b != root) recvs.push(ctx.irecv(b, bytes_at(recv, static_cast<size_t>(b) * block_bytes), block_bytes));
  }
  if (send != recv) std::memcpy(bytes_at(recv, static_cast<size_t>(root) * block_bytes), send, block_bytes);
  recvs.wait_all(ctx);
}

void scatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, int root, Algorithm algo) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t block_bytes = count * dtype_size(dtype);
  if (count == 0) return;
  select_algorithm(OpKind::kScatter, p, block_bytes * static_cast<size_t>(p), algo);
  if (r != root) {
    ctx.wait(ctx.irecv(root, recv, block_bytes));
    return;
  }
  detail::RequestList sends;
  for (int b = 0; b < p; ++b) {
    if (b != root) sends.push(ctx.isend(b, bytes_at(send, static_cast<size_t>(b) * block_bytes), block_bytes));
  }
  if (send != recv) std::memcpy(recv, bytes_at(send, static_cast<size_t>(root) * block_bytes), block_bytes);
  sends.wait_all(ctx);
}

void alltoallv(Context& ctx, const void* send, const size_t* send_counts, const size_t* send_displs, void* recv,
               const size_t* recv_counts, const size_t* recv_displs, DataType dtype, Algorithm algo) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t esize = dtype_size(dtype);
  size_t send_total = 0;
  for (int b = 0; b < p; ++b) send_total = std::max(send_total, (send_displs[b] + send_counts[b]) * esize);
  select_algorithm(OpKind::kAlltoallv, p, send_total, algo);
  const void* input = send;
  if (send == recv) {
    // In place: the input is overwritten while it is still being sent, so send from a copy.
    void* copy = ctx.scratch(send_total, 1);
    if (send_total) std::memcpy(copy, send, send_total);
    input = copy;
  }
  if (recv_counts[r]) {
    std::memcpy(bytes_at(recv, recv_displs[r] * esize), bytes_at(input, send_displs[r] * esize),
                recv_counts[r] * esize);
  }
  pairwise_exchange(ctx, [&](int peer) {
    return ExchangeBlock{bytes_at(input, send_displs[peer] * esize), send_counts[peer] * esize,
                         bytes_at(recv, recv_displs[peer] * esize), recv_counts[peer] * esize};
  });
}

void alltoall(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, Algorithm algo) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t block_bytes = count * dtype_size(dtype);
  const size_t total = block_bytes * static_cast<size_t>(p);
  if (count == 0) return;
  select_algorithm(OpKind::kAlltoall, p, total, algo);
  const void* input = send;
  if (send == recv) {
    void* copy = ctx.scratch(total, 1);
    std::memcpy(copy, send, total);
    input = copy;
  }
  std::memcpy(bytes_at(recv, static_cast<size_t>(r) * block_bytes),
              bytes_at(input, static_cast<size_t>(r) * block_bytes), block_bytes);
  pairwise_exchange(ctx, [&](int peer) {
    const size_t at = static_cast<size_t>(peer) * block_bytes;
    return ExchangeBlock{bytes_at(input, at), block_bytes, bytes_at(recv, at), block_bytes};
  });
}

// Dissemination: in round k every rank signals r + 2^k and waits for r - 2^k; after ceil(log2 p)
// rounds every rank has (transitively) heard from every other.
void barrier(Context& ctx, Algorithm algo) {
  const int p = ctx.size();
  const int r = ctx.rank();
  select_algorithm(OpKind::kBarrier, p, 0, algo);
  const char token = 1;
  char got = 0;
  for (int dist = 1; dist < p; dist <<= 1) {
    detail::sendrecv(ctx, mod(r + dist, p), &token, 1, mod(r - dist, p), &got, 1);
  }
}

}  // namespace cohort::coll
