#pragma once
// The intra-host fast path (default; COHORT_TRANSPORT=tcp or COHORT_SHM_COLLECTIVES=0 turn it off):
// when every rank of a communicator is on one host (equal HostIdentity::shm_key()), allreduce,
// reduce_scatter, allgather, broadcast and barrier run on a shm::Group (src/collectives/shm/group.h)
// working in shared memory directly, and so do allgatherv, alltoall(v), gather and scatter from the
// group's single-copy size on (where its check at start allowed single copy); everything else, and
// every communicator spanning hosts, uses the coll:: algorithms over the transports.
// communicator_ops.cc calls the collectives through this namespace (`algo::`).
//
// Error semantics are the transports' (communicator_impl_shm.cc): each call publishes the operation's
// number and signature in the rank's control line and the peers compare it (MismatchError naming both
// ranks and calls); waits observe abort(), the operation's deadline (TimeoutError naming the ranks
// that did not arrive), slow-rank warnings and failure notices from the transports; a dead peer
// (pidfd) fails the operation within one 50 ms sleep slice, named by rank and host.

#include <algorithm>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/shm/group.h"
#include "comm/communicator_impl.h"

namespace cohort::comm::shm_path {

using coll::reduce;

// Hierarchical allreduce for L ranks on each of H hosts: (1) allreduce inside the host over shared
// memory, (2) local rank l allreduces slice l of the buffer with the ranks of local rank l on the other
// hosts (L independent cross-host rings, so every local rank and link works), (3) inside the host, each
// local rank broadcasts its slice to the others. avg divides by L in (1) and by H in (2).
// The group of an all-local communicator, set up for the current operation's signature; or null.
inline shm::Group* local_group(CommunicatorImpl& c) {
  shm::Group* g = c.shm_group();
  if (g) g->set_call(c.shm_call());
  return g;
}

inline void hierarchical_allreduce(CommunicatorImpl& c, shm::Group& host, const void* send, void* recv,
                                   size_t count, DataType dtype, ReduceOp op) {
  host.set_call(c.shm_call());
  host.allreduce(send, recv, count, dtype, op);
  const size_t es = dtype_size(dtype);
  const size_t L = static_cast<size_t>(host.size());
  const size_t per = (count + L - 1) / L;
  auto begin = [&](size_t l) { return std::min(count, l * per); };
  auto length = [&](size_t l) { return std::min(count, (l + 1) * per) - begin(l); };
  char* out = static_cast<char*>(recv);
  const size_t mine = static_cast<size_t>(host.rank());
  if (length(mine) > 0)
    c.cross_host()->allreduce(out + begin(mine) * es, out + begin(mine) * es, length(mine), dtype, op);
  for (size_t l = 0; l < L; ++l)
    if (length(l) > 0) host.broadcast(out + begin(l) * es, length(l) * es, static_cast<int>(l));
}

inline void allreduce(CommunicatorImpl& c, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  if (shm::Group* g = local_group(c)) return g->allreduce(send, recv, count, dtype, op);
  if (shm::Group* h = c.host_group()) return hierarchical_allreduce(c, *h, send, recv, count, dtype, op);
  coll::allreduce(c, send, recv, count, dtype, op);
}

// On an all-local communicator the group decides, from the ranks' published signatures, whether the
// call runs in place on shared memory and whether it ends with a shared allocation
// (shm::Group::allreduce_shareable); elsewhere it is a plain allreduce and allocates nothing.
inline std::shared_ptr<void> allreduce_shareable(CommunicatorImpl& c, void* buf, size_t count, DataType dtype,
                                                 ReduceOp op, bool want_shared) {
  if (shm::Group* g = local_group(c)) return g->allreduce_shareable(buf, count, dtype, op, want_shared);
  allreduce(c, buf, buf, count, dtype, op);
  return nullptr;
}

// One pass over shared memory where both buffers allow it (shm::Group::allreduce_update); otherwise the
// allreduce (any of the paths above), then the update of the whole range on every rank.
inline void allreduce_update(CommunicatorImpl& c, float* grads, float* params, size_t count, ReduceOp op,
                             const Communicator::ParameterUpdate& update) {
  if (shm::Group* g = local_group(c); g && g->allreduce_update(grads, params, count, op, update)) return;
  allreduce(c, grads, grads, count, DataType::kFloat32, op);
  if (count > 0) update(0, count, grads, params);
}

inline void reduce_scatter(CommunicatorImpl& c, const void* send, void* recv, size_t recv_count, DataType dtype,
                           ReduceOp op) {
  if (shm::Group* g = local_group(c)) return g->reduce_scatter(send, recv, recv_count, dtype, op);
  coll::reduce_scatter(c, send, recv, recv_count, dtype, op);
}

inline void allgather(CommunicatorImpl& c, const void* send, void* recv, size_t count, DataType dtype) {
  if (shm::Group* g = local_group(c)) return g->allgather(send, recv, count * dtype_size(dtype));
  coll::allgather(c, send, recv, count, dtype);
}

inline void broadcast(CommunicatorImpl& c, void* buf, size_t count, DataType dtype, int root) {
  if (shm::Group* g = local_group(c)) return g->broadcast(buf, count * dtype_size(dtype), root);
  coll::broadcast(c, buf, count, dtype, root);
}

// The collectives below go to the group only on its single-copy path, decided from sizes every rank
// has alike (the signature's count); alltoallv's sizes differ between ranks, so it goes whenever the
// group copies single at all. Otherwise over the transports, as before.
inline shm::Group* single_copy_group(CommunicatorImpl& c, size_t bytes) {
  shm::Group* g = c.shm_group();
  if (!g || !g->single_copy_for(bytes)) return nullptr;
  g->set_call(c.shm_call());
  return g;
}

inline void allgatherv(CommunicatorImpl& c, const void* send, size_t send_count, void* recv, const size_t* recv_counts,
                       DataType dtype) {
  size_t total = 0;
  for (int q = 0; q < c.size(); ++q) total += recv_counts[q];
  if (shm::Group* g = single_copy_group(c, total * dtype_size(dtype)))
    return g->allgatherv(send, send_count, recv, recv_counts, dtype_size(dtype));
  coll::allgatherv(c, send, send_count, recv, recv_counts, dtype);
}

inline void alltoall(CommunicatorImpl& c, const void* send, void* recv, size_t count, DataType dtype) {
  const size_t P = static_cast<size_t>(c.size());
  if (shm::Group* g = single_copy_group(c, count * P * dtype_size(dtype))) {
    std::vector<size_t> counts(P, count), displs(P);
    for (size_t q = 0; q < P; ++q) displs[q] = q * count;
    return g->alltoallv(send, counts.data(), displs.data(), recv, counts.data(), displs.data(), dtype_size(dtype));
  }
  coll::alltoall(c, send, recv, count, dtype);
}

inline void alltoallv(CommunicatorImpl& c, const void* send, const size_t* send_counts, const size_t* send_displs,
                      void* recv, const size_t* recv_counts, const size_t* recv_displs, DataType dtype) {
  if (shm::Group* g = c.shm_group(); g && g->single_copy()) {
    g->set_call(c.shm_call());
    return g->alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype_size(dtype));
  }
  coll::alltoallv(c, send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
}

inline void gather(CommunicatorImpl& c, const void* send, void* recv, size_t count, DataType dtype, int root) {
  if (shm::Group* g = single_copy_group(c, count * static_cast<size_t>(c.size()) * dtype_size(dtype)))
    return g->gather(send, recv, count * dtype_size(dtype), root);
  coll::gather(c, send, recv, count, dtype, root);
}

inline void scatter(CommunicatorImpl& c, const void* send, void* recv, size_t count, DataType dtype, int root) {
  if (shm::Group* g = single_copy_group(c, count * static_cast<size_t>(c.size()) * dtype_size(dtype)))
    return g->scatter(send, recv, count * dtype_size(dtype), root);
  coll::scatter(c, send, recv, count, dtype, root);
}

inline void barrier(CommunicatorImpl& c) {
  if (shm::Group* g = local_group(c)) return g->barrier();
  coll::barrier(c);
}

}  // namespace cohort::comm::shm_path
