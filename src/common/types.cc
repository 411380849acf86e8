#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "cohort/types.h"
#include "common/deadline.h"

namespace cohort {

std::string_view dtype_name(DataType t) {
  switch (t) {
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kFloat16: return "half";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float";
    case DataType::kFloat64: return "double";
  }
  return "?";
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kAvg: return "avg";
  }
  return "?";
}

std::optional<DataType> parse_dtype(std::string_view s) {
  std::string l(s);
  std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return std::tolower(c); });
  if (l == "int8" || l == "char") return DataType::kInt8;
  if (l == "uint8" || l == "byte") return DataType::kUInt8;
  if (l == "int32" || l == "int") return DataType::kInt32;
  if (l == "int64" || l == "long") return DataType::kInt64;
  if (l == "float16" || l == "half" || l == "fp16") return DataType::kFloat16;
  if (l == "bfloat16" || l == "bf16") return DataType::kBFloat16;
  if (l == "float32" || l == "float" || l == "fp32") return DataType::kFloat32;
  if (l == "float64" || l == "double" || l == "fp64") return DataType::kFloat64;
  return std::nullopt;
}

std::optional<ReduceOp> parse_reduce_op(std::string_view s) {
  std::string l(s);
  std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return std::tolower(c); });
  if (l == "sum") return ReduceOp::kSum;
  if (l == "prod" || l == "product") return ReduceOp::kProd;
  if (l == "min") return ReduceOp::kMin;
  if (l == "max") return ReduceOp::kMax;
  if (l == "avg" || l == "mean") return ReduceOp::kAvg;
  return std::nullopt;
}

std::string format_duration(std::chrono::nanoseconds d) {
  double s = std::chrono::duration<double>(d).count();
  if (s < 1e-3) return fmt::format("{:.0f} us", s * 1e6);
  if (s < 1.0) return fmt::format("{:.0f} ms", s * 1e3);
  return fmt::format("{:.1f} s", s);
}

}  // namespace cohort
