#pragma once
// The intra-host fast path: when every rank of a communicator is on one host (equal
// HostIdentity::shm_key()) and COHORT_TRANSPORT is not "tcp", allreduce, reduce_scatter, allgather,
// broadcast and barrier run on a shm::Group (src/collectives/shm/group.h) working in shared memory
// directly; everything else, and every communicator spanning hosts, uses the coll:: algorithms over
// the transports. communicator_impl.cc calls the collectives through this namespace (`algo::`).
//
// What the shm path does not do (yet): compare the ranks' call signatures (a mismatched call is not
// diagnosed as MismatchError; sizes must match, as the API requires) and observe Communicator::abort()
// while waiting (the group's own deadline, dead-peer detection and failure flags still apply).

#include "collectives/collectives.h"
#include "collectives/shm/group.h"
#include "comm/communicator_impl.h"

namespace cohort::comm::shm_path {

using coll::allgatherv;
using coll::alltoall;
using coll::alltoallv;
using coll::gather;
using coll::reduce;
using coll::scatter;

inline void allreduce(CommunicatorImpl& c, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  if (shm::Group* g = c.shm_group()) return g->allreduce(send, recv, count, dtype, op);
  coll::allreduce(c, send, recv, count, dtype, op);
}

inline void reduce_scatter(CommunicatorImpl& c, const void* send, void* recv, size_t recv_count, DataType dtype,
                           ReduceOp op) {
  if (shm::Group* g = c.shm_group()) return g->reduce_scatter(send, recv, recv_count, dtype, op);
  coll::reduce_scatter(c, send, recv, recv_count, dtype, op);
}

inline void allgather(CommunicatorImpl& c, const void* send, void* recv, size_t count, DataType dtype) {
  if (shm::Group* g = c.shm_group()) return g->allgather(send, recv, count * dtype_size(dtype));
  coll::allgather(c, send, recv, count, dtype);
}

inline void broadcast(CommunicatorImpl& c, void* buf, size_t count, DataType dtype, int root) {
  if (shm::Group* g = c.shm_group()) return g->broadcast(buf, count * dtype_size(dtype), root);
  coll::broadcast(c, buf, count, dtype, root);
}

inline void barrier(CommunicatorImpl& c) {
  if (shm::Group* g = c.shm_group()) return g->barrier();
  coll::barrier(c);
}

}  // namespace cohort::comm::shm_path
