// Portable reference kernels. The vectorised ones (reduce_kernels_simd.cc) must agree with these.
// Callers may pass any address (buffers are bytes to the transports), so elements are read and written
// through a 1-aligned type: unaligned access through a plain typed pointer is undefined behaviour
// (UBSan said so in the kernel tests).
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

// T with an alignment of 1 (GCC's aligned attribute may lower it on a typedef): a defined access at any
// address, compiled to the same movss/mov as an aligned one (memcpy into a float goes through an
// integer register with GCC 12, 10 % slower in the scalar benchmark).
template <typename T>
struct Unaligned {
  typedef T type __attribute__((aligned(1), may_alias));
};

template <typename T>
inline T load(const void* p, size_t i) {
  return static_cast<const typename Unaligned<T>::type*>(p)[i];
}
template <typename T>
inline void store(void* p, size_t i, T v) {
  static_cast<typename Unaligned<T>::type*>(p)[i] = v;
}

template <typename T>
void reduce_typed(void* dst, const void* a, const void* b, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) store<T>(dst, i, apply(load<T>(a, i), load<T>(b, i), op));
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void reduce_16(void* dst, const void* a, const void* b, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i)
    store<uint16_t>(dst, i, Store(apply(Load(load<uint16_t>(a, i)), Load(load<uint16_t>(b, i)), op)));
}

template <typename T>
void divide_typed(void* p, size_t n, int divisor) {
  for (size_t i = 0; i < n; ++i) store<T>(p, i, static_cast<T>(load<T>(p, i) / static_cast<T>(divisor)));
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void divide_16(void* p, size_t n, int divisor) {
  for (size_t i = 0; i < n; ++i) store<uint16_t>(p, i, Store(Load(load<uint16_t>(p, i)) / static_cast<float>(divisor)));
}

}  // namespace

void reduce_to_scalar(void* dst, const void* a, const void* b, size_t n, DataType t, ReduceOp op) {
  switch (t) {
    case DataType::kInt8: return reduce_typed<int8_t>(dst, a, b, n, op);
    case DataType::kUInt8: return reduce_typed<uint8_t>(dst, a, b, n, op);
    case DataType::kInt32: return reduce_typed<int32_t>(dst, a, b, n, op);
    case DataType::kInt64: return reduce_typed<int64_t>(dst, a, b, n, op);
    case DataType::kFloat32: return reduce_typed<float>(dst, a, b, n, op);
    case DataType::kFloat64: return reduce_typed<double>(dst, a, b, n, op);
    case DataType::kFloat16: return reduce_16<half_to_float, float_to_half>(dst, a, b, n, op);
    case DataType::kBFloat16: return reduce_16<bf16_to_float, float_to_bf16>(dst, a, b, n, op);
  }
}

void reduce_into_scalar(void* dst, const void* src, size_t n, DataType t, ReduceOp op) {
  reduce_to_scalar(dst, dst, src, n, t, op);
}

void finish_average_scalar(void* data, size_t n, DataType t, int divisor) {
  switch (t) {
    case DataType::kFloat32: return divide_typed<float>(data, n, divisor);
    case DataType::kFloat64: return divide_typed<double>(data, n, divisor);
    case DataType::kFloat16: return divide_16<half_to_float, float_to_half>(data, n, divisor);
    case DataType::kBFloat16: return divide_16<bf16_to_float, float_to_bf16>(data, n, divisor);
    default: return;  // avg is rejected for integer types before any data moves
  }
}

}  // namespace cohort::kernels
