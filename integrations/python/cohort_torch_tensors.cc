// cohort_torch_tensors.h: tensors to cohort's terms.

#include "cohort_torch_tensors.h"

namespace cohort_torch {

cohort::DataType to_cohort_dtype(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kChar: return cohort::DataType::kInt8;
    case at::kByte: return cohort::DataType::kUInt8;
    case at::kInt: return cohort::DataType::kInt32;
    case at::kLong: return cohort::DataType::kInt64;
    case at::kHalf: return cohort::DataType::kFloat16;
    case at::kBFloat16: return cohort::DataType::kBFloat16;
    case at::kFloat: return cohort::DataType::kFloat32;
    case at::kDouble: return cohort::DataType::kFloat64;
    default: break;
  }
  TORCH_CHECK(false, "cohort backend: ", op, " does not support dtype ", t.scalar_type(),
              "; supported: int8, uint8, int32, int64, float16, bfloat16, float32, float64");
}

cohort::ReduceOp to_cohort_op(const c10d::ReduceOp& op, cohort::DataType dtype,
                              const char* what) {
  cohort::ReduceOp out;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: out = cohort::ReduceOp::kSum; break;
    case c10d::ReduceOp::PRODUCT: out = cohort::ReduceOp::kProd; break;
    case c10d::ReduceOp::MIN: out = cohort::ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: out = cohort::ReduceOp::kMax; break;
    case c10d::ReduceOp::AVG: out = cohort::ReduceOp::kAvg; break;
    default:
      TORCH_CHECK(false, "cohort backend: ", what, " does not support reduce op ",
                  static_cast<int>(op.op_),
                  " (BAND/BOR/BXOR/PREMUL_SUM); supported: SUM, PRODUCT, MIN, MAX, AVG");
  }
  TORCH_CHECK(cohort::op_supported(dtype, out), "cohort backend: ", what,
              ": ReduceOp.AVG needs a floating-point tensor, got ", cohort::dtype_name(dtype));
  return out;
}

void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "cohort backend: ", op, ": undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "cohort backend: ", op,
              " supports CPU tensors only, got a tensor on ", t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "cohort backend: ", op,
              " supports dense (strided) tensors only, got layout ", t.layout());
}

void check_single(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "cohort backend: ", op,
              " takes exactly one tensor per rank, got ", tensors.size());
  check_tensor(tensors[0], op);
}

void check_same_type(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "cohort backend: ", op,
              ": tensors must share one dtype, got ", a.scalar_type(), " and ", b.scalar_type());
}

// One contiguous buffer holding `tensors` back to back (flattened).
at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// A tensor's elements as a flat byte tensor (a contiguous copy when it is not contiguous).
at::Tensor as_bytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous().reshape({-1});
  return c.numel() == 0 ? at::empty({0}, at::kByte) : c.view(at::kByte);
}

// Writes `bytes` (t.numel() * t.element_size() of them) into t's elements.
void as_bytes_view(const at::Tensor& t, const at::Tensor& bytes) {
  if (t.numel() == 0) return;
  t.copy_(bytes.view(t.scalar_type()).view(t.sizes()));
}

// Copies consecutive slices of `flat` into `tensors` (the inverse of flatten).
void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

}  // namespace cohort_torch
