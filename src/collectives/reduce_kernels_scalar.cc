// Portable reference kernels. The vectorised ones (reduce_kernels_simd.cc) must agree with these.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "collectives/reduce_kernels.h"
#include "collectives/reduce_kernels_impl.h"
#include "common/half.h"

namespace cohort::kernels {
namespace {

template <typename T>
inline T apply(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return static_cast<T>(a + b);
    case ReduceOp::kProd: return static_cast<T>(a * b);
    case ReduceOp::kMin: return std::min(a, b);
    case ReduceOp::kMax: return std::max(a, b);
  }
  return a;
}

template <typename T>
void reduce_typed(T* dst, const T* a, const T* b, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) dst[i] = apply(a[i], b[i], op);
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void reduce_16(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) dst[i] = Store(apply(Load(a[i]), Load(b[i]), op));
}

}  // namespace

void reduce_to_scalar(void* dst, const void* a, const void* b, size_t n, DataType t, ReduceOp op) {
  switch (t) {
    case DataType::kInt8:
      return reduce_typed(static_cast<int8_t*>(dst), static_cast<const int8_t*>(a), static_cast<const int8_t*>(b), n, op);
    case DataType::kUInt8:
      return reduce_typed(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), n, op);
    case DataType::kInt32:
      return reduce_typed(static_cast<int32_t*>(dst), static_cast<const int32_t*>(a), static_cast<const int32_t*>(b), n, op);
    case DataType::kInt64:
      return reduce_typed(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a), static_cast<const int64_t*>(b), n, op);
    case DataType::kFloat32:
      return reduce_typed(static_cast<float*>(dst), static_cast<const float*>(a), static_cast<const float*>(b), n, op);
    case DataType::kFloat64:
      return reduce_typed(static_cast<double*>(dst), static_cast<const double*>(a), static_cast<const double*>(b), n, op);
    case DataType::kFloat16:
      return reduce_16<half_to_float, float_to_half>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                                                     static_cast<const uint16_t*>(b), n, op);
    case DataType::kBFloat16:
      return reduce_16<bf16_to_float, float_to_bf16>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                                                     static_cast<const uint16_t*>(b), n, op);
  }
}

void reduce_into_scalar(void* dst, const void* src, size_t n, DataType t, ReduceOp op) {
  reduce_to_scalar(dst, dst, src, n, t, op);
}

void finish_average_scalar(void* data, size_t n, DataType t, int divisor) {
  switch (t) {
    case DataType::kFloat32: {
      auto* p = static_cast<float*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = static_cast<float>(p[i] / static_cast<float>(divisor));
      return;
    }
    case DataType::kFloat64: {
      auto* p = static_cast<double*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = p[i] / divisor;
      return;
    }
    case DataType::kFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_half(half_to_float(p[i]) / static_cast<float>(divisor));
      return;
    }
    case DataType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_bf16(bf16_to_float(p[i]) / static_cast<float>(divisor));
      return;
    }
    default:
      return;  // avg is rejected for integer types before any data moves
  }
}

}  // namespace cohort::kernels
