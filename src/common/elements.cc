#include "common/elements.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/half.h"

namespace cohort {

void store_element(void* buf, size_t i, DataType t, double v) {
  switch (t) {
    case DataType::kInt8: static_cast<int8_t*>(buf)[i] = static_cast<int8_t>(v); break;
    case DataType::kUInt8: static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>(v); break;
    case DataType::kInt32: static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v); break;
    case DataType::kInt64: static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v); break;
    case DataType::kFloat16: static_cast<uint16_t*>(buf)[i] = float_to_half(static_cast<float>(v)); break;
    case DataType::kBFloat16: static_cast<uint16_t*>(buf)[i] = float_to_bf16(static_cast<float>(v)); break;
    case DataType::kFloat32: static_cast<float*>(buf)[i] = static_cast<float>(v); break;
    case DataType::kFloat64: static_cast<double*>(buf)[i] = v; break;
  }
}

double load_element(const void* buf, size_t i, DataType t) {
  switch (t) {
    case DataType::kInt8: return static_cast<const int8_t*>(buf)[i];
    case DataType::kUInt8: return static_cast<const uint8_t*>(buf)[i];
    case DataType::kInt32: return static_cast<const int32_t*>(buf)[i];
    case DataType::kInt64: return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
    case DataType::kFloat16: return half_to_float(static_cast<const uint16_t*>(buf)[i]);
    case DataType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(buf)[i]);
    case DataType::kFloat32: return static_cast<const float*>(buf)[i];
    case DataType::kFloat64: return static_cast<const double*>(buf)[i];
  }
  return 0;
}

double check_input(int rank, size_t i, DataType t, ReduceOp op) {
  const size_t r = static_cast<size_t>(rank);
  const bool is_unsigned = t == DataType::kUInt8;
  double v;
  if (op == ReduceOp::kProd) {
    v = rank == 0 ? double(i % 3 + 1) : ((i + r) % 4 == 0 ? 2.0 : 1.0);
    if (!is_unsigned && (i + 2 * r) % 5 == 0) v = -v;
  } else {
    v = double(int((r * 7 + i * 3) % 11) - 5);
    if (is_unsigned) v = std::fabs(v);
  }
  return v;
}

double check_expected(int world, size_t i, DataType t, ReduceOp op) {
  double acc = fold_reference(world, op, [&](int r) { return check_input(r, i, t, op); });
  if (t == DataType::kUInt8 && op == ReduceOp::kProd) acc = double(uint8_t(int64_t(acc)));
  if (t == DataType::kInt8 && op == ReduceOp::kProd) acc = double(int8_t(int64_t(acc)));
  return acc;
}

double check_tolerance(DataType t, double expected) {
  const double scale = std::max(1.0, std::fabs(expected));
  if (t == DataType::kFloat16) return 2e-3 * scale + 1e-3;
  if (t == DataType::kBFloat16) return 1e-2 * scale + 1e-2;
  if (t == DataType::kFloat32) return 1e-5 * scale;
  return 1e-9;
}

}  // namespace cohort
