#include "common/elements.h"

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

}  // namespace cohort
