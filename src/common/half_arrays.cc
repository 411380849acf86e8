#include "common/half_arrays.h"

#include <immintrin.h>

#include <cstring>

#include "common/cpu_features.h"
#include "common/half.h"
#include "common/vector_clones.h"

namespace cohort {

// bfloat16: the scalar rule (half.h) written without branches, so that the compiler vectorizes it;
// one clone per vector width, picked at load time.
COHORT_VECTOR_KERNEL
void floats_to_bf16(const float* __restrict src, uint16_t* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &src[i], sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    dst[i] = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
}

COHORT_VECTOR_KERNEL
void bf16_to_floats(const uint16_t* __restrict src, float* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(&dst[i], &bits, sizeof bits);
  }
}

// float16: the F16C instructions convert 8 values at a time, rounding to nearest even like
// float_to_half (subnormals, overflow to infinity and all); the tail and CPUs without F16C take the
// scalar functions.
namespace {

__attribute__((target("avx,f16c"))) size_t floats_to_half_f16c(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  return i;
}

__attribute__((target("avx,f16c"))) size_t half_to_floats_f16c(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  return i;
}

// __builtin_cpu_init first: this runs among the static initializers, which may precede libgcc's own.
const bool kHaveF16c = [] {
  __builtin_cpu_init();
  return cpu_has_f16c() && __builtin_cpu_supports("avx");
}();

}  // namespace

void floats_to_half(const float* src, uint16_t* dst, size_t n) {
  size_t i = kHaveF16c ? floats_to_half_f16c(src, dst, n) : 0;
  for (; i < n; ++i) dst[i] = float_to_half(src[i]);
}

void half_to_floats(const uint16_t* src, float* dst, size_t n) {
  size_t i = kHaveF16c ? half_to_floats_f16c(src, dst, n) : 0;
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

}  // namespace cohort
