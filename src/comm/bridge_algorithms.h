#pragma once
// TEMPORARY bridge: simple, correct collective algorithms over coll::Context, with the same
// signatures as the coll:: entry points (src/collectives/collectives.h on branch `coll`).
// The communicator calls them through the `algo` namespace alias in communicator_impl.cc; when
// the coll branch is merged the alias points at cohort::coll and this file is deleted.

#include <cstddef>

#include "cohort/types.h"
#include "collectives/context.h"

namespace cohort::comm::bridge {

using coll::Context;

void allreduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op);
void reduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root);
void broadcast(Context& ctx, void* buf, size_t count, DataType dtype, int root);
void allgather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype);
void allgatherv(Context& ctx, const void* send, size_t send_count, void* recv, const size_t* recv_counts,
                DataType dtype);
void gather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, int root);
void scatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, int root);
void reduce_scatter(Context& ctx, const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op);
void alltoall(Context& ctx, const void* send, void* recv, size_t count, DataType dtype);
void alltoallv(Context& ctx, const void* send, const size_t* send_counts, const size_t* send_displs, void* recv,
               const size_t* recv_counts, const size_t* recv_displs, DataType dtype);
void barrier(Context& ctx);

}  // namespace cohort::comm::bridge
