// CommunicatorImpl (communicator_impl.h): the collectives. Each is validated on the calling thread
// (InvalidArgument leaves the communicator usable), described (OpDesc: kind, types, sizes, which every
// rank's signature must match) and run through the algorithm chosen for it (comm/shm_path.h: the
// shared-memory group on one host, else src/collectives/).
#include "comm/shm_path.h"
#include <fmt/core.h>

#include "cohort/error.h"
#include "comm/communicator_impl.h"
#include "comm/communicator_internal.h"

namespace cohort::comm {

namespace algo = cohort::comm::shm_path;

// ------------------------------------------------------------------------------------------------
// Validation (before anything is sent; InvalidArgument leaves the communicator usable)

void CommunicatorImpl::validate_dtype_op(DataType dtype, ReduceOp op, bool needs_op) const {
  if (uint8_t(dtype) >= kNumDataTypes) throw InvalidArgument(fmt::format("unknown dtype {}", int(dtype)));
  if (!needs_op) return;
  if (uint8_t(op) >= kNumReduceOps) throw InvalidArgument(fmt::format("unknown reduce op {}", int(op)));
  if (!op_supported(dtype, op)) {
    throw InvalidArgument(fmt::format("reduce op {} is not defined on dtype {} (avg needs a floating type)",
                                      reduce_op_name(op), dtype_name(dtype)));
  }
}

void CommunicatorImpl::validate_buffer(const void* p, size_t count, const char* what) const {
  if (p == nullptr && count > 0) throw InvalidArgument(fmt::format("{} buffer is null with count {}", what, count));
}

void CommunicatorImpl::validate_root(int root) const {
  if (root < 0 || root >= size_) throw InvalidArgument(fmt::format("root {} out of range [0, {})", root, size_));
}

// ------------------------------------------------------------------------------------------------
// Collectives

void CommunicatorImpl::allreduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  validate_dtype_op(dtype, op, true);
  validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kAllreduce, dtype, op, 0, count, count * dtype_size(dtype)};
  run_blocking(d, [&] { algo::allreduce(*this, send, recv, count, dtype, op); });
}

void CommunicatorImpl::allreduce_update(float* grads, float* params, size_t count, ReduceOp op,
                                        const ParameterUpdate& update) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg)
    throw InvalidArgument(fmt::format("allreduce_update: op {} (sum or avg only)", reduce_op_name(op)));
  if (!update) throw InvalidArgument("allreduce_update: update is empty");
  validate_buffer(grads, count, "grads");
  validate_buffer(params, count, "params");
  OpDesc d{OpKind::kAllreduce, DataType::kFloat32, op, 0, count, count * sizeof(float)};
  d.flags = coll::kOpFlagParameterUpdate;  // a peer calling a plain allreduce here mismatches
  run_blocking(d, [&] { algo::allreduce_update(*this, grads, params, count, op, update); });
}

std::shared_ptr<void> CommunicatorImpl::allreduce_shareable(void* buf, size_t count, DataType dtype, ReduceOp op,
                                                           bool want_shared) {
  validate_dtype_op(dtype, op, true);
  validate_buffer(buf, count, "buf");
  OpDesc d{OpKind::kAllreduce, dtype, op, 0, count, count * dtype_size(dtype)};
  d.flags = coll::kOpFlagShareable;  // a peer calling a plain allreduce here mismatches
  // The request is only worth passing on where allocate_shared gives memory the peers map.
  want_shared = want_shared && one_pass_update();
  std::shared_ptr<void> memory;
  run_blocking(d, [&] { memory = algo::allreduce_shareable(*this, buf, count, dtype, op, want_shared); });
  return memory;
}

bool CommunicatorImpl::one_pass_update() const {
  // What allocate_shared needs to hand out memory the peers map (the group's allreduce_update).
  return shm_group_ != nullptr && shm_shared_buffers_enabled();
}

void CommunicatorImpl::reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root) {
  validate_dtype_op(dtype, op, true);
  validate_root(root);
  validate_buffer(send, count, "send");
  if (rank_ == root) validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kReduce, dtype, op, root, count, count * dtype_size(dtype)};
  run_blocking(d, [&] { algo::reduce(*this, send, recv, count, dtype, op, root); });
}

void CommunicatorImpl::broadcast(void* buf, size_t count, DataType dtype, int root) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_root(root);
  validate_buffer(buf, count, "broadcast");
  OpDesc d{OpKind::kBroadcast, dtype, ReduceOp::kSum, root, count, count * dtype_size(dtype)};
  run_blocking(d, [&] { algo::broadcast(*this, buf, count, dtype, root); });
}

void CommunicatorImpl::allgather(const void* send, void* recv, size_t count, DataType dtype) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kAllgather, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype) * size_t(size_)};
  run_blocking(d, [&] { algo::allgather(*this, send, recv, count, dtype); });
}

void CommunicatorImpl::allgatherv(const void* send, size_t send_count, void* recv,
                                  const std::vector<size_t>& recv_counts, DataType dtype) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  if (recv_counts.size() != size_t(size_)) {
    throw InvalidArgument(fmt::format("allgatherv: recv_counts has {} entries, expected {}", recv_counts.size(), size_));
  }
  if (recv_counts[size_t(rank_)] != send_count) {
    throw InvalidArgument(fmt::format("allgatherv: send_count {} differs from recv_counts[{}] = {}", send_count, rank_,
                                      recv_counts[size_t(rank_)]));
  }
  size_t total = 0;
  for (size_t c : recv_counts) total += c;
  validate_buffer(send, send_count, "send");
  validate_buffer(recv, total, "recv");
  OpDesc d{OpKind::kAllgatherv, dtype, ReduceOp::kSum, 0, total, total * dtype_size(dtype)};
  run_blocking(d, [&] { algo::allgatherv(*this, send, send_count, recv, recv_counts.data(), dtype); });
}

void CommunicatorImpl::gather(const void* send, void* recv, size_t count, DataType dtype, int root) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_root(root);
  validate_buffer(send, count, "send");
  if (rank_ == root) validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kGather, dtype, ReduceOp::kSum, root, count, count * dtype_size(dtype)};
  run_blocking(d, [&] { algo::gather(*this, send, recv, count, dtype, root); });
}

void CommunicatorImpl::scatter(const void* send, void* recv, size_t count, DataType dtype, int root) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_root(root);
  if (rank_ == root) validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kScatter, dtype, ReduceOp::kSum, root, count, count * dtype_size(dtype)};
  run_blocking(d, [&] { algo::scatter(*this, send, recv, count, dtype, root); });
}

void CommunicatorImpl::reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) {
  validate_dtype_op(dtype, op, true);
  validate_buffer(send, recv_count, "send");
  validate_buffer(recv, recv_count, "recv");
  OpDesc d{OpKind::kReduceScatter, dtype, op, 0, recv_count, recv_count * dtype_size(dtype) * size_t(size_)};
  run_blocking(d, [&] { algo::reduce_scatter(*this, send, recv, recv_count, dtype, op); });
}

void CommunicatorImpl::alltoall(const void* send, void* recv, size_t count, DataType dtype) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kAlltoall, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype) * size_t(size_)};
  run_blocking(d, [&] { algo::alltoall(*this, send, recv, count, dtype); });
}

void CommunicatorImpl::alltoallv(const void* send, const std::vector<size_t>& send_counts,
                                 const std::vector<size_t>& send_displs, void* recv,
                                 const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                                 DataType dtype) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  for (auto* v : {&send_counts, &send_displs, &recv_counts, &recv_displs}) {
    if (v->size() != size_t(size_)) {
      throw InvalidArgument(fmt::format("alltoallv: a count/displacement vector has {} entries, expected {}",
                                        v->size(), size_));
    }
  }
  size_t sent = 0, received = 0;
  for (int r = 0; r < size_; ++r) {
    sent += send_counts[size_t(r)];
    received += recv_counts[size_t(r)];
  }
  if (send != recv) validate_buffer(send, sent, "send");
  validate_buffer(recv, received, "recv");
  OpDesc d{OpKind::kAlltoallv, dtype, ReduceOp::kSum, 0, 0, sent * dtype_size(dtype)};
  run_blocking(d, [&] {
    algo::alltoallv(*this, send, send_counts.data(), send_displs.data(), recv, recv_counts.data(),
                    recv_displs.data(), dtype);
  });
}

void CommunicatorImpl::barrier() {
  OpDesc d{OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0, 0};
  run_blocking(d, [&] { algo::barrier(*this); });
}

// ------------------------------------------------------------------------------------------------
// Asynchronous variants

std::shared_ptr<Work> CommunicatorImpl::allreduce_async(const void* send, void* recv, size_t count, DataType dtype,
                                                        ReduceOp op) {
  validate_dtype_op(dtype, op, true);
  validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kAllreduce, dtype, op, 0, count, count * dtype_size(dtype)};
  return run_async(d, [=, this] { algo::allreduce(*this, send, recv, count, dtype, op); });
}

std::shared_ptr<Work> CommunicatorImpl::broadcast_async(void* buf, size_t count, DataType dtype, int root) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_root(root);
  validate_buffer(buf, count, "broadcast");
  OpDesc d{OpKind::kBroadcast, dtype, ReduceOp::kSum, root, count, count * dtype_size(dtype)};
  return run_async(d, [=, this] { algo::broadcast(*this, buf, count, dtype, root); });
}

std::shared_ptr<Work> CommunicatorImpl::allgather_async(const void* send, void* recv, size_t count, DataType dtype) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kAllgather, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype) * size_t(size_)};
  return run_async(d, [=, this] { algo::allgather(*this, send, recv, count, dtype); });
}

std::shared_ptr<Work> CommunicatorImpl::reduce_scatter_async(const void* send, void* recv, size_t recv_count,
                                                             DataType dtype, ReduceOp op) {
  validate_dtype_op(dtype, op, true);
  validate_buffer(send, recv_count, "send");
  validate_buffer(recv, recv_count, "recv");
  OpDesc d{OpKind::kReduceScatter, dtype, op, 0, recv_count, recv_count * dtype_size(dtype) * size_t(size_)};
  return run_async(d, [=, this] { algo::reduce_scatter(*this, send, recv, recv_count, dtype, op); });
}

std::shared_ptr<Work> CommunicatorImpl::barrier_async() {
  OpDesc d{OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0, 0};
  return run_async(d, [this] { algo::barrier(*this); });
}

}  // namespace cohort::comm
