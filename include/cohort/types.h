#pragma once
// Element types and reduction operators understood by every collective.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace cohort {

enum class DataType : uint8_t {
  kInt8 = 0,
  kUInt8 = 1,
  kInt32 = 2,
  kInt64 = 3,
  kFloat16 = 4,
  kBFloat16 = 5,
  kFloat32 = 6,
  kFloat64 = 7,
};
inline constexpr int kNumDataTypes = 8;

enum class ReduceOp : uint8_t {
  kSum = 0,
  kProd = 1,
  kMin = 2,
  kMax = 3,
  kAvg = 4,  // float types only: sum, then divide by the number of contributors
};
inline constexpr int kNumReduceOps = 5;

// Bytes per element.
constexpr size_t dtype_size(DataType t) {
  switch (t) {
    case DataType::kInt8:
    case DataType::kUInt8: return 1;
    case DataType::kFloat16:
    case DataType::kBFloat16: return 2;
    case DataType::kInt32:
    case DataType::kFloat32: return 4;
    case DataType::kInt64:
    case DataType::kFloat64: return 8;
  }
  return 0;
}

constexpr bool is_floating(DataType t) {
  return t == DataType::kFloat16 || t == DataType::kBFloat16 || t == DataType::kFloat32 ||
         t == DataType::kFloat64;
}

// Names as nccl-tests prints them: int8 uint8 int32 int64 half bfloat16 float double.
std::string_view dtype_name(DataType t);
std::string_view reduce_op_name(ReduceOp op);
// Accepts nccl-tests and torch spellings (float, float32, fp32, half, fp16, bf16, double, ...).
std::optional<DataType> parse_dtype(std::string_view s);
std::optional<ReduceOp> parse_reduce_op(std::string_view s);

// Whether `op` is defined on `t` (avg only on floating types).
constexpr bool op_supported(DataType t, ReduceOp op) { return op != ReduceOp::kAvg || is_floating(t); }

}  // namespace cohort
