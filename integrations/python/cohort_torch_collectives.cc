// The backend's collectives (ProcessGroupCohort, cohort_torch_group.h): each checks its tensors on the
// calling thread, then queues the communicator call to the group's worker thread (enqueue). The first
// line of each hands CUDA tensors to cohort_torch_cuda.cc (COHORT_ROUTE_CUDA).

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cohort_torch_group.h"
#include "cohort_torch_shared_storage.h"
#include "cohort_torch_tensors.h"

namespace cohort_torch {

// ---- reductions ----

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::ALLREDUCE, Args().list(tensors), Args().list(tensors), allreduce(tensors, opts));
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse)
    return sparse_allreduce(tensors[0], opts);
  check_single(tensors, "allreduce");
  const auto dtype = to_cohort_dtype(tensors[0], "allreduce");
  const auto op = to_cohort_op(opts.reduceOp, dtype, "allreduce");
  Staged t(tensors[0]);
  return enqueue(opts.timeout, c10d::OpType::ALLREDUCE, tensors, [this, t, dtype, op] {
    if (t.count() == 0) return;
    // A staged copy (a non-contiguous tensor) goes the same way: a peer's tensor may be contiguous.
    shared_storage_.allreduce(t.buf, t.buf.is_same(t.user), dtype, op);
    t.copy_back();
  });
}

// allreduce of a sparse COO tensor (SUM), as gloo does it: every rank's indices and values are
// gathered (allgatherv), and each rank's tensor becomes their coalesced sum. The ranks' tensors must
// agree in sizes and sparse/dense dimensions; their numbers of entries may differ.
c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::sparse_allreduce(const at::Tensor& tensor,
                                                                    const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(tensor.device().is_cpu(), "cohort backend: allreduce of a sparse tensor on ", tensor.device(),
              ": only CPU sparse tensors are supported");
  TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM, "cohort backend: allreduce of a sparse tensor supports ",
              "ReduceOp.SUM only");
  TORCH_CHECK(tensor.dim() <= kSparseMaxDims, "cohort backend: allreduce of a sparse tensor supports up to ",
              kSparseMaxDims, " dimensions, got ", tensor.dim());
  const auto dtype = to_cohort_dtype(tensor, "allreduce (sparse)");
  at::Tensor user = tensor;
  return enqueue(opts.timeout, c10d::OpType::ALLREDUCE, {tensor}, [this, user, dtype] {
    const at::Tensor input = user.coalesce();
    const int64_t sparse_dim = input.sparse_dim();
    const at::Tensor indices = input._indices().t().contiguous();  // [nnz, sparse_dim]
    const at::Tensor values = input._values().contiguous();        // [nnz, dense sizes...]
    const int64_t nnz = input._nnz();
    // Metadata, the same on every rank but the count: nnz, sparse_dim, dim, sizes.
    std::vector<int64_t> meta(3 + kSparseMaxDims, -1), all(meta.size() * size_);
    meta[0] = nnz;
    meta[1] = sparse_dim;
    meta[2] = input.dim();
    for (int64_t d = 0; d < input.dim(); ++d) meta[3 + d] = input.size(d);
    comm_->allgather(meta.data(), all.data(), meta.size(), cohort::DataType::kInt64);
    std::vector<size_t> entries(size_);
    int64_t total = 0;
    for (int r = 0; r < size_; ++r) {
      const int64_t* theirs = &all[r * meta.size()];
      TORCH_CHECK(std::equal(meta.begin() + 1, meta.end(), theirs + 1), "cohort backend: allreduce of a sparse ",
                  "tensor: rank ", r, "'s tensor differs in sizes or sparse dimensions from rank ", rank_, "'s");
      entries[r] = static_cast<size_t>(theirs[0]);
      total += theirs[0];
    }
    int64_t value_row = 1;  // elements of one entry's value (the dense dimensions)
    for (int64_t d = 1; d < values.dim(); ++d) value_row *= values.size(d);
    std::vector<int64_t> value_shape = values.sizes().vec();
    value_shape[0] = total;
    at::Tensor all_indices = at::empty({total, sparse_dim}, indices.options());
    at::Tensor all_values = at::empty(value_shape, values.options());
    std::vector<size_t> index_counts, value_counts;
    for (size_t e : entries) {
      index_counts.push_back(e * static_cast<size_t>(sparse_dim));
      value_counts.push_back(e * static_cast<size_t>(value_row));
    }
    comm_->allgatherv(indices.data_ptr(), nnz * sparse_dim, all_indices.data_ptr(), index_counts,
                      cohort::DataType::kInt64);
    comm_->allgatherv(values.data_ptr(), nnz * value_row, all_values.data_ptr(), value_counts, dtype);
    user.copy_(at::sparse_coo_tensor(all_indices.t(), all_values, input.sizes()).coalesce());
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allreduce_coalesced(
                        std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::ALLREDUCE_COALESCED, Args().list(tensors), Args().list(tensors),
                    allreduce_coalesced(tensors, opts));
  TORCH_CHECK(!tensors.empty(), "cohort backend: allreduce_coalesced needs at least one tensor");
  for (const auto& t : tensors) {
    check_tensor(t, "allreduce_coalesced");
    check_same_type(t, tensors[0], "allreduce_coalesced");
  }
  const auto dtype = to_cohort_dtype(tensors[0], "allreduce_coalesced");
  const auto op = to_cohort_op(opts.reduceOp, dtype, "allreduce_coalesced");
  std::vector<at::Tensor> outputs = tensors;
  return enqueue(opts.timeout, c10d::OpType::ALLREDUCE_COALESCED, tensors, [this, outputs, dtype, op] {
    at::Tensor flat = flatten(outputs);
    if (flat.numel() == 0) return;
    comm_->allreduce(flat.data_ptr(), flat.data_ptr(), flat.numel(), dtype, op);
    unflatten_into(flat, outputs);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::REDUCE, Args().list(tensors), Args().list(tensors), reduce(tensors, opts));
  check_single(tensors, "reduce");
  check_root(opts.rootRank, "reduce");
  TORCH_CHECK(opts.rootTensor == 0, "cohort backend: reduce: rootTensor must be 0");
  const auto dtype = to_cohort_dtype(tensors[0], "reduce");
  const auto op = to_cohort_op(opts.reduceOp, dtype, "reduce");
  const int root = static_cast<int>(opts.rootRank);
  Staged t(tensors[0]);
  return enqueue(opts.timeout, c10d::OpType::REDUCE, tensors, [this, t, dtype, op, root] {
    if (t.count() == 0) return;
    comm_->reduce(t.data(), t.data(), t.count(), dtype, op, root);
    if (rank_ == root) t.copy_back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::reduce_scatter(
                        std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                        const c10d::ReduceScatterOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::REDUCE_SCATTER, Args().list(outputs).lists(inputs), Args().list(outputs),
                    reduce_scatter(outputs, inputs, opts));
  check_single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, "cohort backend: reduce_scatter takes one input list");
  check_list(inputs[0], outputs[0], "reduce_scatter");
  const auto dtype = to_cohort_dtype(outputs[0], "reduce_scatter");
  const auto op = to_cohort_op(opts.reduceOp, dtype, "reduce_scatter");
  std::vector<at::Tensor> in = inputs[0];
  Staged out(outputs[0]);
  return enqueue(opts.timeout, c10d::OpType::REDUCE_SCATTER, outputs, [this, in, out, dtype, op] {
    at::Tensor send = flatten(in);
    comm_->reduce_scatter(send.data_ptr(), out.data(), out.count(), dtype, op);
    out.copy_back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::_reduce_scatter_base(
                        at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::_REDUCE_SCATTER_BASE, Args().one(output).one(input), Args().one(output),
                    _reduce_scatter_base(output, input, opts));
  check_tensor(output, "reduce_scatter_tensor");
  check_tensor(input, "reduce_scatter_tensor");
  check_same_type(output, input, "reduce_scatter_tensor");
  TORCH_CHECK(input.numel() == output.numel() * size_, "cohort backend: reduce_scatter_tensor: ",
              "input must hold world_size (", size_, ") x output's ", output.numel(),
              " elements, got ", input.numel());
  const auto dtype = to_cohort_dtype(output, "reduce_scatter_tensor");
  const auto op = to_cohort_op(opts.reduceOp, dtype, "reduce_scatter_tensor");
  Staged in(input), out(output);
  return enqueue(opts.timeout, c10d::OpType::_REDUCE_SCATTER_BASE, {output}, [this, in, out, dtype, op] {
    comm_->reduce_scatter(in.data(), out.data(), out.count(), dtype, op);
    out.copy_back();
  });
}

// ---- data movement ----

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::BROADCAST, Args().list(tensors), Args().list(tensors), broadcast(tensors, opts));
  check_single(tensors, "broadcast");
  check_root(opts.rootRank, "broadcast");
  TORCH_CHECK(opts.rootTensor == 0, "cohort backend: broadcast: rootTensor must be 0");
  const auto dtype = to_cohort_dtype(tensors[0], "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  Staged t(tensors[0]);
  return enqueue(opts.timeout, c10d::OpType::BROADCAST, tensors, [this, t, dtype, root] {
    if (t.count() == 0) return;
    comm_->broadcast(t.data(), t.count(), dtype, root);
    t.copy_back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::ALLGATHER, Args().lists(outputs).list(inputs), Args().lists(outputs),
                    allgather(outputs, inputs, opts));
  check_single(inputs, "allgather");
  TORCH_CHECK(outputs.size() == 1, "cohort backend: allgather takes one output list");
  check_list(outputs[0], inputs[0], "allgather");
  const auto dtype = to_cohort_dtype(inputs[0], "allgather");
  Staged in(inputs[0]);
  std::vector<at::Tensor> out = outputs[0];
  return enqueue(opts.timeout, c10d::OpType::ALLGATHER, out, [this, in, out, dtype] {
    at::Tensor recv = at::empty({static_cast<int64_t>(in.count()) * size_}, in.buf.options());
    comm_->allgather(in.data(), recv.data_ptr(), in.count(), dtype);
    unflatten_into(recv, out);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::_ALLGATHER_BASE, Args().one(output).one(input), Args().one(output),
                    _allgather_base(output, input, opts));
  check_tensor(output, "all_gather_into_tensor");
  check_tensor(input, "all_gather_into_tensor");
  check_same_type(output, input, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == input.numel() * size_,
              "cohort backend: all_gather_into_tensor: output must hold world_size (", size_,
              ") x input's ", input.numel(), " elements, got ", output.numel());
  const auto dtype = to_cohort_dtype(input, "all_gather_into_tensor");
  Staged in(input), out(output);
  return enqueue(opts.timeout, c10d::OpType::_ALLGATHER_BASE, {output}, [this, in, out, dtype] {
    comm_->allgather(in.data(), out.data(), in.count(), dtype);
    out.copy_back();
  });
}

// all_gather_coalesced: several tensors at once, of any shapes and dtypes (each rank's list alike).
// They travel as one allgather of their bytes; output_lists[r][i] receives rank r's inputs[i].
c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::ALLGATHER_COALESCED, Args().lists(output_lists).list(inputs),
                    Args().lists(output_lists), allgather_coalesced(output_lists, inputs, opts));
  TORCH_CHECK(static_cast<int>(output_lists.size()) == size_, "cohort backend: all_gather_coalesced: ",
              "output_tensor_lists must hold world_size (", size_, ") lists, got ", output_lists.size());
  for (const auto& t : inputs) check_tensor(t, "all_gather_coalesced");
  for (size_t r = 0; r < output_lists.size(); ++r) {
    TORCH_CHECK(output_lists[r].size() == inputs.size(), "cohort backend: all_gather_coalesced: output list ", r,
                " holds ", output_lists[r].size(), " tensors, the input list ", inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& out = output_lists[r][i];
      check_tensor(out, "all_gather_coalesced");
      check_same_type(out, inputs[i], "all_gather_coalesced");
      TORCH_CHECK(out.sizes() == inputs[i].sizes(), "cohort backend: all_gather_coalesced: output ", r, "[", i,
                  "] has shape ", out.sizes(), ", its input ", inputs[i].sizes());
    }
  }
  std::vector<at::Tensor> in = inputs, out;
  for (const auto& list : output_lists) out.insert(out.end(), list.begin(), list.end());
  return enqueue(opts.timeout, c10d::OpType::ALLGATHER_COALESCED, out, [this, in, out] {
    std::vector<at::Tensor> bytes;
    for (const auto& t : in) bytes.push_back(as_bytes(t));
    at::Tensor send = bytes.empty() ? at::empty({0}, at::kByte) : at::cat(bytes);
    const int64_t n = send.numel();
    if (n == 0) return;
    at::Tensor recv = at::empty({n * size_}, at::kByte);
    comm_->allgather(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(n), cohort::DataType::kUInt8);
    int64_t offset = 0;
    for (const auto& t : out) {
      const int64_t len = t.numel() * static_cast<int64_t>(t.element_size());
      as_bytes_view(t, recv.narrow(0, offset, len));
      offset += len;
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::GatherOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::GATHER, Args().lists(outputs).list(inputs), Args().lists(outputs),
                    gather(outputs, inputs, opts));
  check_single(inputs, "gather");
  check_root(opts.rootRank, "gather");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> out;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1, "cohort backend: gather: the root takes one output list");
    check_list(outputs[0], inputs[0], "gather");
    out = outputs[0];
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "cohort backend: gather: only the root (rank ", root, ") passes outputs");
  }
  const auto dtype = to_cohort_dtype(inputs[0], "gather");
  Staged in(inputs[0]);
  return enqueue(opts.timeout, c10d::OpType::GATHER, out, [this, in, out, dtype, root] {
    at::Tensor recv;
    if (rank_ == root) {
      recv = at::empty({static_cast<int64_t>(in.count()) * size_}, in.buf.options());
    }
    comm_->gather(in.data(), recv.defined() ? recv.data_ptr() : nullptr, in.count(), dtype,
                  root);
    if (rank_ == root) unflatten_into(recv, out);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ScatterOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::SCATTER, Args().list(outputs).lists(inputs), Args().list(outputs),
                    scatter(outputs, inputs, opts));
  check_single(outputs, "scatter");
  check_root(opts.rootRank, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> in;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1, "cohort backend: scatter: the root takes one input list");
    check_list(inputs[0], outputs[0], "scatter");
    in = inputs[0];
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "cohort backend: scatter: only the root (rank ", root, ") passes inputs");
  }
  const auto dtype = to_cohort_dtype(outputs[0], "scatter");
  Staged out(outputs[0]);
  return enqueue(opts.timeout, c10d::OpType::SCATTER, outputs, [this, in, out, dtype, root] {
    at::Tensor send;
    if (rank_ == root) send = flatten(in);
    comm_->scatter(send.defined() ? send.data_ptr() : nullptr, out.data(), out.count(), dtype,
                   root);
    out.copy_back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                 std::vector<int64_t>& output_splits,
                                                                 std::vector<int64_t>& input_splits,
                                                                 const c10d::AllToAllOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::ALLTOALL_BASE, Args().one(output).one(input), Args().one(output),
                    alltoall_base(output, input, output_splits, input_splits, opts));
  check_tensor(output, "all_to_all_single");
  check_tensor(input, "all_to_all_single");
  check_same_type(output, input, "all_to_all_single");
  const auto dtype = to_cohort_dtype(input, "all_to_all_single");
  Staged in(input), out(output);
  if (output_splits.empty() && input_splits.empty()) {
    TORCH_CHECK(input.numel() == output.numel() && input.numel() % size_ == 0,
                "cohort backend: all_to_all_single without splits needs input and output of ",
                "equal size divisible by world_size (", size_, "), got ", input.numel(), " and ",
                output.numel());
    return enqueue(opts.timeout, c10d::OpType::ALLTOALL_BASE, {output}, [this, in, out, dtype] {
      comm_->alltoall(in.data(), out.data(), in.count() / size_, dtype);
      out.copy_back();
    });
  }
  auto send_counts = split_counts(input, input_splits, "input");
  auto recv_counts = split_counts(output, output_splits, "output");
  return enqueue(opts.timeout, c10d::OpType::ALLTOALL_BASE, {output},
                 [this, in, out, dtype, send_counts, recv_counts] {
                   comm_->alltoallv(in.data(), send_counts, displacements(send_counts),
                                    out.data(), recv_counts, displacements(recv_counts), dtype);
                   out.copy_back();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  COHORT_ROUTE_CUDA(c10d::OpType::ALLTOALL, Args().list(outputs).list(inputs), Args().list(outputs),
                    alltoall(outputs, inputs, opts));
  TORCH_CHECK(static_cast<int>(inputs.size()) == size_ &&
                  static_cast<int>(outputs.size()) == size_,
              "cohort backend: all_to_all takes world_size (", size_,
              ") input and output tensors, got ", inputs.size(), " and ", outputs.size());
  std::vector<size_t> send_counts, recv_counts;
  for (int r = 0; r < size_; ++r) {
    check_tensor(inputs[r], "all_to_all");
    check_tensor(outputs[r], "all_to_all");
    check_same_type(inputs[r], inputs[0], "all_to_all");
    check_same_type(outputs[r], inputs[0], "all_to_all");
    send_counts.push_back(inputs[r].numel());
    recv_counts.push_back(outputs[r].numel());
  }
  const auto dtype = to_cohort_dtype(inputs[0], "all_to_all");
  std::vector<at::Tensor> in = inputs, out = outputs;
  return enqueue(opts.timeout, c10d::OpType::ALLTOALL, outputs,
                 [this, in, out, dtype, send_counts, recv_counts] {
                   at::Tensor send = flatten(in);
                   size_t total = 0;
                   for (auto c : recv_counts) total += c;
                   at::Tensor recv = at::empty({static_cast<int64_t>(total)}, send.options());
                   comm_->alltoallv(send.data_ptr(), send_counts, displacements(send_counts),
                                    recv.data_ptr(), recv_counts, displacements(recv_counts),
                                    dtype);
                   unflatten_into(recv, out);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(opts.timeout, c10d::OpType::BARRIER, {}, [this] { comm_->barrier(); });
}

// ---- the checks the collectives share ----

void ProcessGroupCohort::check_root(int64_t root, const char* op) const {
  TORCH_CHECK(root >= 0 && root < size_, "cohort backend: ", op, ": root rank ", root,
              " is outside the group of ", size_, " ranks");
}

// A list of world_size tensors, each with the same dtype and number of elements as `like`.
void ProcessGroupCohort::check_list(const std::vector<at::Tensor>& list, const at::Tensor& like,
                                    const char* op) const {
  TORCH_CHECK(static_cast<int>(list.size()) == size_, "cohort backend: ", op,
              ": the tensor list must hold world_size (", size_, ") tensors, got ", list.size());
  for (const auto& t : list) {
    check_tensor(t, op);
    check_same_type(t, like, op);
    TORCH_CHECK(t.numel() == like.numel(), "cohort backend: ", op,
                ": every tensor in the list must have ", like.numel(), " elements, got ",
                t.numel());
  }
}

// Element counts per rank from torch's split sizes along dimension 0 (empty = equal split).
std::vector<size_t> ProcessGroupCohort::split_counts(const at::Tensor& t, const std::vector<int64_t>& splits,
                                                     const char* which) const {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const int64_t row_elems = rows == 0 ? 0 : t.numel() / rows;
  std::vector<size_t> counts;
  if (splits.empty()) {
    TORCH_CHECK(rows % size_ == 0, "cohort backend: all_to_all_single: ", which,
                " dimension 0 (", rows, ") is not divisible by world_size (", size_, ")");
    counts.assign(size_, static_cast<size_t>(rows / size_ * row_elems));
    return counts;
  }
  TORCH_CHECK(static_cast<int>(splits.size()) == size_, "cohort backend: all_to_all_single: ",
              which, "_split_sizes must have world_size (", size_, ") entries, got ",
              splits.size());
  int64_t total = 0;
  for (auto s : splits) {
    TORCH_CHECK(s >= 0, "cohort backend: all_to_all_single: negative split size ", s);
    total += s;
    counts.push_back(static_cast<size_t>(s * row_elems));
  }
  TORCH_CHECK(total == rows, "cohort backend: all_to_all_single: ", which,
              "_split_sizes sum to ", total, " but dimension 0 is ", rows);
  return counts;
}

std::vector<size_t> ProcessGroupCohort::displacements(const std::vector<size_t>& counts) {
  std::vector<size_t> displs(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) displs[i] = displs[i - 1] + counts[i - 1];
  return displs;
}

}  // namespace cohort_torch
