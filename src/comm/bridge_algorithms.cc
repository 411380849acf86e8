// TEMPORARY (see bridge_algorithms.h): straightforward algorithms until branch `coll` lands.
#include "comm/bridge_algorithms.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/reduce_kernels.h"

namespace cohort::comm::bridge {
namespace {

char* ptr(void* p, size_t off) { return static_cast<char*>(p) + off; }
const char* cptr(const void* p, size_t off) { return static_cast<const char*>(p) + off; }

// Ring allreduce: reduce-scatter then allgather, each block cut into chunks on separate slots so
// that the transfer of chunk k+1 overlaps the reduction of chunk k.
void ring_allreduce(Context& ctx, void* buf, size_t count, DataType dtype, ReduceOp op) {
  const int p = ctx.size(), r = ctx.rank();
  const size_t es = dtype_size(dtype);
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  std::vector<size_t> off(size_t(p) + 1);
  for (int i = 0; i <= p; ++i) off[size_t(i)] = count * size_t(i) / size_t(p);
  size_t max_block = 0;
  for (int i = 0; i < p; ++i) max_block = std::max(max_block, off[size_t(i) + 1] - off[size_t(i)]);
  const size_t chunk_elems = std::max<size_t>(1, (1 << 20) / es);
  char* tmp = static_cast<char*>(ctx.scratch(max_block * es + 1));
  for (int step = 0; step < p - 1; ++step) {
    int sb = (r - step + p) % p, rb = (r - step - 1 + 2 * p) % p;
    size_t sn = off[size_t(sb) + 1] - off[size_t(sb)], rn = off[size_t(rb) + 1] - off[size_t(rb)];
    std::vector<coll::RequestId> recvs, sends;
    for (size_t c = 0, slot = 0; c < std::max<size_t>(rn, 1); c += chunk_elems, ++slot) {
      size_t n = std::min(chunk_elems, rn - std::min(rn, c));
      recvs.push_back(ctx.irecv(prev, tmp + c * es, n * es, uint32_t(slot)));
    }
    for (size_t c = 0, slot = 0; c < std::max<size_t>(sn, 1); c += chunk_elems, ++slot) {
      size_t n = std::min(chunk_elems, sn - std::min(sn, c));
      sends.push_back(ctx.isend(next, ptr(buf, (off[size_t(sb)] + c) * es), n * es, uint32_t(slot)));
    }
    for (size_t c = 0, i = 0; i < recvs.size(); c += chunk_elems, ++i) {
      ctx.wait(recvs[i]);
      size_t n = std::min(chunk_elems, rn - std::min(rn, c));
      if (n) kernels::reduce_into(ptr(buf, (off[size_t(rb)] + c) * es), tmp + c * es, n, dtype, op);
    }
    ctx.wait_all(sends);
  }
  for (int step = 0; step < p - 1; ++step) {
    int sb = (r + 1 - step + p) % p, rb = (r - step + p) % p;
    size_t sn = off[size_t(sb) + 1] - off[size_t(sb)], rn = off[size_t(rb) + 1] - off[size_t(rb)];
    coll::RequestId rq = ctx.irecv(prev, ptr(buf, off[size_t(rb)] * es), rn * es, 0);
    coll::RequestId sq = ctx.isend(next, ptr(buf, off[size_t(sb)] * es), sn * es, 0);
    ctx.wait(rq);
    ctx.wait(sq);
  }
}

// Small messages: everyone sends its vector to everyone; each rank reduces in rank order, so the
// result is bitwise identical everywhere.
void gather_allreduce(Context& ctx, void* buf, size_t count, DataType dtype, ReduceOp op) {
  const int p = ctx.size(), r = ctx.rank();
  const size_t bytes = count * dtype_size(dtype);
  char* all = static_cast<char*>(ctx.scratch(bytes * size_t(p) + 1));
  std::vector<coll::RequestId> reqs;
  for (int k = 1; k < p; ++k) {
    int from = (r - k + p) % p;
    reqs.push_back(ctx.irecv(from, all + size_t(from) * bytes, bytes));
  }
  for (int k = 1; k < p; ++k) reqs.push_back(ctx.isend((r + k) % p, buf, bytes));
  ctx.wait_all(reqs);
  std::memcpy(all + size_t(r) * bytes, buf, bytes);
  std::memcpy(buf, all, bytes);
  for (int k = 1; k < p; ++k) kernels::reduce_into(buf, all + size_t(k) * bytes, count, dtype, op);
}

}  // namespace

void allreduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  const size_t bytes = count * dtype_size(dtype);
  if (send != recv && bytes) std::memcpy(recv, send, bytes);
  if (ctx.size() > 1) {
    if (bytes <= 64 * 1024 || count < size_t(ctx.size())) {
      gather_allreduce(ctx, recv, count, dtype, op);
    } else {
      ring_allreduce(ctx, recv, count, dtype, op);
    }
  }
  if (op == ReduceOp::kAvg) kernels::finish_average(recv, count, dtype, ctx.size());
}

void reduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root) {
  const size_t bytes = count * dtype_size(dtype);
  const bool in_place = send == recv;
  void* work = ctx.scratch(bytes + 1, 1);
  std::memcpy(work, ctx.rank() == root && in_place ? recv : send, bytes);
  allreduce(ctx, work, work, count, dtype, op);
  if (ctx.rank() == root && bytes) std::memcpy(recv, work, bytes);
}

void broadcast(Context& ctx, void* buf, size_t count, DataType dtype, int root) {
  const size_t bytes = count * dtype_size(dtype);
  if (ctx.rank() == root) {
    std::vector<coll::RequestId> reqs;
    for (int k = 0; k < ctx.size(); ++k)
      if (k != root) reqs.push_back(ctx.isend(k, buf, bytes));
    ctx.wait_all(reqs);
  } else {
    ctx.wait(ctx.irecv(root, buf, bytes));
  }
}

void allgatherv(Context& ctx, const void* send, size_t send_count, void* recv, const size_t* recv_counts,
                DataType dtype) {
  const int p = ctx.size(), r = ctx.rank();
  const size_t es = dtype_size(dtype);
  std::vector<size_t> off(size_t(p) + 1, 0);
  for (int i = 0; i < p; ++i) off[size_t(i) + 1] = off[size_t(i)] + recv_counts[i];
  if (send != recv || true) {
    const char* mine = send == recv ? cptr(recv, off[size_t(r)] * es) : static_cast<const char*>(send);
    if (mine != cptr(recv, off[size_t(r)] * es)) std::memmove(ptr(recv, off[size_t(r)] * es), mine, send_count * es);
  }
  std::vector<coll::RequestId> reqs;
  for (int k = 1; k < p; ++k) {
    int from = (r - k + p) % p;
    reqs.push_back(ctx.irecv(from, ptr(recv, off[size_t(from)] * es), recv_counts[from] * es));
  }
  for (int k = 1; k < p; ++k) reqs.push_back(ctx.isend((r + k) % p, cptr(recv, off[size_t(r)] * es), send_count * es));
  ctx.wait_all(reqs);
}

void allgather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype) {
  std::vector<size_t> counts(size_t(ctx.size()), count);
  allgatherv(ctx, send == recv ? recv : send, count, recv, counts.data(), dtype);
}

void gather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, int root) {
  const size_t bytes = count * dtype_size(dtype);
  if (ctx.rank() != root) {
    ctx.wait(ctx.isend(root, send, bytes));
    return;
  }
  std::vector<coll::RequestId> reqs;
  for (int k = 0; k < ctx.size(); ++k)
    if (k != root) reqs.push_back(ctx.irecv(k, ptr(recv, size_t(k) * bytes), bytes));
  if (send != recv && bytes) std::memcpy(ptr(recv, size_t(root) * bytes), send, bytes);
  ctx.wait_all(reqs);
}

void scatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, int root) {
  const size_t bytes = count * dtype_size(dtype);
  if (ctx.rank() != root) {
    ctx.wait(ctx.irecv(root, recv, bytes));
    return;
  }
  std::vector<coll::RequestId> reqs;
  for (int k = 0; k < ctx.size(); ++k)
    if (k != root) reqs.push_back(ctx.isend(k, cptr(send, size_t(k) * bytes), bytes));
  if (send != recv && bytes) std::memcpy(recv, cptr(send, size_t(root) * bytes), bytes);
  ctx.wait_all(reqs);
}

void reduce_scatter(Context& ctx, const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype), p = size_t(ctx.size());
  char* work = static_cast<char*>(ctx.scratch(recv_count * es * p + 1, 1));
  std::memcpy(work, send == recv ? recv : send, recv_count * es * p);
  allreduce(ctx, work, work, recv_count * p, dtype, op);
  std::memcpy(recv, work + size_t(ctx.rank()) * recv_count * es, recv_count * es);
}

void alltoallv(Context& ctx, const void* send, const size_t* send_counts, const size_t* send_displs, void* recv,
               const size_t* recv_counts, const size_t* recv_displs, DataType dtype) {
  const int p = ctx.size(), r = ctx.rank();
  const size_t es = dtype_size(dtype);
  const void* src = send;
  if (send == recv) {
    size_t total = 0;
    for (int i = 0; i < p; ++i) total = std::max(total, (send_displs[i] + send_counts[i]) * es);
    void* copy = ctx.scratch(total + 1, 1);
    std::memcpy(copy, recv, total);
    src = copy;
  }
  std::vector<coll::RequestId> reqs;
  for (int k = 1; k < p; ++k) {
    int from = (r - k + p) % p;
    reqs.push_back(ctx.irecv(from, ptr(recv, recv_displs[from] * es), recv_counts[from] * es));
  }
  for (int k = 1; k < p; ++k) {
    int to = (r + k) % p;
    reqs.push_back(ctx.isend(to, cptr(src, send_displs[to] * es), send_counts[to] * es));
  }
  std::memmove(ptr(recv, recv_displs[r] * es), cptr(src, send_displs[r] * es), recv_counts[r] * es);
  ctx.wait_all(reqs);
}

void alltoall(Context& ctx, const void* send, void* recv, size_t count, DataType dtype) {
  std::vector<size_t> counts(size_t(ctx.size()), count), displs(size_t(ctx.size()));
  for (size_t i = 0; i < displs.size(); ++i) displs[i] = i * count;
  alltoallv(ctx, send, counts.data(), displs.data(), recv, counts.data(), displs.data(), dtype);
}

void barrier(Context& ctx) {
  // Dissemination: ceil(log2 p) rounds, round k talks to rank +- 2^k.
  const int p = ctx.size(), r = ctx.rank();
  char token = 0, got = 0;
  for (int d = 1, k = 0; d < p; d <<= 1, ++k) {
    coll::RequestId rq = ctx.irecv((r - d + p) % p, &got, 1, uint32_t(k));
    coll::RequestId sq = ctx.isend((r + d) % p, &token, 1, uint32_t(k));
    ctx.wait(rq);
    ctx.wait(sq);
  }
}

}  // namespace cohort::comm::bridge
