// Tensors to cohort's terms: dtype and reduce-op mapping, the checks every operation makes on the
// calling thread (a bad dtype, device or shape is a RuntimeError at once), and the staging of
// non-contiguous tensors through contiguous copies.
#pragma once

#include <cstddef>
#include <vector>

#include "cohort/types.h"
#include "cohort_torch_common.h"

namespace cohort_torch {

cohort::DataType to_cohort_dtype(const at::Tensor& t, const char* op);
cohort::ReduceOp to_cohort_op(const c10d::ReduceOp& op, cohort::DataType dtype, const char* what);

// A CPU, dense (strided) tensor; `op` names the operation in the error.
void check_tensor(const at::Tensor& t, const char* op);
// Exactly one tensor per rank, checked as above.
void check_single(const std::vector<at::Tensor>& tensors, const char* op);
void check_same_type(const at::Tensor& a, const at::Tensor& b, const char* op);

// The tensor a collective reads or writes: the user's tensor when it is contiguous, else a
// contiguous copy that is copied back (for outputs) when the operation is done.
struct Staged {
  at::Tensor user;
  at::Tensor buf;
  explicit Staged(const at::Tensor& t) : user(t), buf(t.is_contiguous() ? t : t.contiguous()) {}
  void* data() const { return buf.data_ptr(); }
  size_t count() const { return static_cast<size_t>(buf.numel()); }
  void copy_back() const {
    if (!buf.is_same(user)) user.copy_(buf);
  }
};

// One contiguous buffer holding `tensors` back to back (flattened).
at::Tensor flatten(const std::vector<at::Tensor>& tensors);
// A tensor's elements as a flat byte tensor (a contiguous copy when it is not contiguous).
at::Tensor as_bytes(const at::Tensor& t);
// Writes `bytes` (t.numel() * t.element_size() of them) into t's elements.
void as_bytes_view(const at::Tensor& t, const at::Tensor& bytes);
// Copies consecutive slices of `flat` into `tensors` (the inverse of flatten).
void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors);

}  // namespace cohort_torch
