// Vectorised reduction kernels (AVX2, AVX-512) and the run-time dispatcher behind reduce_into/reduce_to.
//
// Each family is compiled with GCC's `#pragma GCC target` (clang: `#pragma clang attribute`, the sanitizer
// build's compiler), which gives every function in its region the
// same target attribute as `__attribute__((target("...")))`: the rest of the program stays baseline x86-64
// and the family is only called after __builtin_cpu_supports() said the CPU has it. The vector body
// handles whole vectors; the remainder (fewer than one vector) goes through the scalar reference, so odd
// lengths and any alignment (unaligned loads/stores throughout) are exact by construction.
//
// Bit-exactness with reduce_kernels_scalar.cc:
//  * float min/max: std::min(a, b) is `b < a ? b : a`; MINPS(x, y) is `x < y ? x : y`, so we call
//    min(b, a) (same for max). NaNs and signed zeros then pick the same operand as the reference.
//  * float16: F16C/AVX-512 conversions are exact one way and round to nearest even the other; the
//    hardware keeps a NaN's payload where the reference writes the canonical quiet NaN (sign|0x7e00), so
//    NaN lanes are patched after the conversion. bfloat16 uses the reference's integer rounding.
//  * integer products keep the low bits (as the reference's static_cast does): 8-bit lanes multiply as
//    16-bit pairs, 64-bit lanes from 32x32 partial products on AVX2 (VPMULLQ on AVX-512).
// GCC 12's own AVX-512 headers trip -Wmaybe-uninitialized (their `__m512 __Y = __Y` idiom for
// "undefined" registers); the warning is about the header, not this file.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "collectives/reduce_kernels.h"
#include "collectives/reduce_kernels_impl.h"
#include "cohort/error.h"
#include "common/cpu_features.h"
#include "common/env.h"

namespace cohort::kernels {
namespace {

// The generic vector loop: V supplies load/store and the four operations on its register type.
// The template is instantiated from inside each target region, so its code is generated for that ISA.
#define COHORT_DEFINE_VECTOR_LOOPS                                                                      \
  template <class V, int Op>                                                                            \
  inline typename V::R combine(typename V::R a, typename V::R b) {                                     \
    if constexpr (Op == 0) return V::add(a, b);                                                         \
    else if constexpr (Op == 1) return V::mul(a, b);                                                    \
    else if constexpr (Op == 2) return V::min(a, b);                                                    \
    else return V::max(a, b);                                                                           \
  }                                                                                                     \
  template <class V, int Op>                                                                            \
  size_t loop_op(void* dst, const void* a, const void* b, size_t n) {                                   \
    using T = typename V::T;                                                                            \
    T* d = static_cast<T*>(dst);                                                                        \
    const T* x = static_cast<const T*>(a);                                                              \
    const T* y = static_cast<const T*>(b);                                                              \
    constexpr size_t L = V::kLanes;                                                                     \
    size_t i = 0;                                                                                       \
    for (; i + 2 * L <= n; i += 2 * L) {                                                                \
      typename V::R r0 = combine<V, Op>(V::load(x + i), V::load(y + i));                               \
      typename V::R r1 = combine<V, Op>(V::load(x + i + L), V::load(y + i + L));                       \
      V::store(d + i, r0);                                                                              \
      V::store(d + i + L, r1);                                                                          \
    }                                                                                                   \
    for (; i + L <= n; i += L) V::store(d + i, combine<V, Op>(V::load(x + i), V::load(y + i)));         \
    return i;                                                                                           \
  }                                                                                                     \
  /* Returns how many leading elements were done; the caller finishes the rest with the reference. */  \
  template <class V>                                                                                    \
  size_t loop(void* dst, const void* a, const void* b, size_t n, ReduceOp op) {                        \
    switch (op) {                                                                                       \
      case ReduceOp::kSum:                                                                              \
      case ReduceOp::kAvg: return loop_op<V, 0>(dst, a, b, n);                                          \
      case ReduceOp::kProd: return loop_op<V, 1>(dst, a, b, n);                                         \
      case ReduceOp::kMin: return loop_op<V, 2>(dst, a, b, n);                                          \
      case ReduceOp::kMax: return loop_op<V, 3>(dst, a, b, n);                                          \
    }                                                                                                   \
    return 0;                                                                                           \
  }                                                                                                     \
  /* data[i] /= divisor (kAvg's last step), the reference's IEEE division lane by lane. */             \
  template <class V>                                                                                    \
  size_t divide_loop(void* data, size_t n, int divisor) {                                               \
    using T = typename V::T;                                                                            \
    T* d = static_cast<T*>(data);                                                                       \
    const typename V::R by = V::splat(divisor);                                                         \
    constexpr size_t L = V::kLanes;                                                                     \
    size_t i = 0;                                                                                       \
    for (; i + L <= n; i += L) V::store(d + i, V::div(V::load(d + i), by));                              \
    return i;                                                                                           \
  }                                                                                                     \
  size_t divide(void* data, size_t n, DataType t, int divisor) {                                        \
    switch (t) {                                                                                        \
      case DataType::kFloat32: return divide_loop<F32>(data, n, divisor);                               \
      case DataType::kFloat64: return divide_loop<F64>(data, n, divisor);                               \
      case DataType::kFloat16: return divide_loop<F16>(data, n, divisor);                               \
      case DataType::kBFloat16: return divide_loop<BF16>(data, n, divisor);                             \
      default: return 0;                                                                                \
    }                                                                                                   \
  }                                                                                                     \
  size_t reduce(void* d, const void* a, const void* b, size_t n, DataType t, ReduceOp op) {            \
    switch (t) {                                                                                        \
      case DataType::kInt8: return loop<I8>(d, a, b, n, op);                                            \
      case DataType::kUInt8: return loop<U8>(d, a, b, n, op);                                           \
      case DataType::kInt32: return loop<I32>(d, a, b, n, op);                                          \
      case DataType::kInt64: return loop<I64>(d, a, b, n, op);                                          \
      case DataType::kFloat16: return loop<F16>(d, a, b, n, op);                                        \
      case DataType::kBFloat16: return loop<BF16>(d, a, b, n, op);                                      \
      case DataType::kFloat32: return loop<F32>(d, a, b, n, op);                                        \
      case DataType::kFloat64: return loop<F64>(d, a, b, n, op);                                        \
    }                                                                                                   \
    return 0;                                                                                           \
  }

// bfloat16: widened to fp32 lanes (a 16-bit shift), combined as fp32, rounded to nearest even on store
// with the reference's integer arithmetic; a NaN stays a quiet NaN of the same sign. Each family
// supplies widen_u16, select_nan and store_low_u16, the steps whose intrinsics differ.
#define COHORT_DEFINE_BF16(P, SI)                                                                       \
  struct BF16 : F32 {                                                                                   \
    using T = uint16_t;                                                                                 \
    static R load(const uint16_t* p) { return P##_cast##SI##_ps(P##_slli_epi32(widen_u16(p), 16)); }    \
    static void store(uint16_t* p, R v) {                                                               \
      auto bits = P##_castps_##SI(v);                                                                   \
      auto high = P##_srli_epi32(bits, 16);                                                             \
      auto bias = P##_add_epi32(P##_set1_epi32(0x7fff), P##_and_##SI(high, P##_set1_epi32(1)));         \
      auto rounded = P##_srli_epi32(P##_add_epi32(bits, bias), 16);                                     \
      auto quiet_nan = P##_or_##SI(high, P##_set1_epi32(0x40));                                         \
      store_low_u16(p, select_nan(v, rounded, quiet_nan));                                              \
    }                                                                                                   \
  };

// A floating-point lane type: Name holds L values of Type in register R, intrinsics P_op_S (S: ps, pd).
// min/max take (b, a) for the reference's NaN and signed-zero choice (see the top of this file).
#define COHORT_DEFINE_FLOAT_LANES(P, Name, Type, Reg, S, L)                                             \
  struct Name {                                                                                         \
    using T = Type;                                                                                     \
    using R = Reg;                                                                                      \
    static constexpr size_t kLanes = L;                                                                 \
    static R load(const T* p) { return P##_loadu_##S(p); }                                              \
    static void store(T* p, R v) { P##_storeu_##S(p, v); }                                              \
    static R add(R a, R b) { return P##_add_##S(a, b); }                                                \
    static R mul(R a, R b) { return P##_mul_##S(a, b); }                                                \
    static R min(R a, R b) { return P##_min_##S(b, a); }                                                \
    static R max(R a, R b) { return P##_max_##S(b, a); }                                                \
    static R div(R a, R b) { return P##_div_##S(a, b); }                                                \
    static R splat(int v) { return P##_set1_##S(static_cast<T>(v)); }                                   \
  };

// The lane types whose intrinsics differ between AVX2 and AVX-512 only by their prefix P (_mm256,
// _mm512) and integer suffix SI (si256, si512): registers FR/DR/IR of W bytes. 64-bit integers and
// float16's conversions really differ between the two, and each family writes those itself.
#define COHORT_DEFINE_PREFIXED_LANES(P, SI, FR, DR, IR, W)                                              \
  COHORT_DEFINE_FLOAT_LANES(P, F32, float, FR, ps, W / 4)                                               \
  COHORT_DEFINE_FLOAT_LANES(P, F64, double, DR, pd, W / 8)                                              \
  template <typename Elem>                                                                              \
  struct IntBase {                                                                                      \
    using T = Elem;                                                                                     \
    using R = IR;                                                                                       \
    static constexpr size_t kLanes = W / sizeof(Elem);                                                  \
    static R load(const T* p) { return P##_loadu_##SI(reinterpret_cast<const IR*>(p)); }               \
    static void store(T* p, R v) { P##_storeu_##SI(reinterpret_cast<IR*>(p), v); }                     \
  };                                                                                                    \
  /* Low 8 bits of each byte product, from two 16-bit multiplies (even bytes, odd bytes). */            \
  inline IR mul_bytes(IR a, IR b) {                                                                     \
    IR even = P##_mullo_epi16(a, b);                                                                    \
    IR odd = P##_mullo_epi16(P##_srli_epi16(a, 8), P##_srli_epi16(b, 8));                               \
    return P##_or_##SI(P##_and_##SI(even, P##_set1_epi16(0xff)), P##_slli_epi16(odd, 8));               \
  }                                                                                                     \
  struct I8 : IntBase<int8_t> {                                                                         \
    static R add(R a, R b) { return P##_add_epi8(a, b); }                                               \
    static R mul(R a, R b) { return mul_bytes(a, b); }                                                  \
    static R min(R a, R b) { return P##_min_epi8(a, b); }                                               \
    static R max(R a, R b) { return P##_max_epi8(a, b); }                                               \
  };                                                                                                    \
  struct U8 : IntBase<uint8_t> {                                                                        \
    static R add(R a, R b) { return P##_add_epi8(a, b); }                                               \
    static R mul(R a, R b) { return mul_bytes(a, b); }                                                  \
    static R min(R a, R b) { return P##_min_epu8(a, b); }                                               \
    static R max(R a, R b) { return P##_max_epu8(a, b); }                                               \
  };                                                                                                    \
  struct I32 : IntBase<int32_t> {                                                                       \
    static R add(R a, R b) { return P##_add_epi32(a, b); }                                              \
    static R mul(R a, R b) { return P##_mullo_epi32(a, b); }                                            \
    static R min(R a, R b) { return P##_min_epi32(a, b); }                                              \
    static R max(R a, R b) { return P##_max_epi32(a, b); }                                              \
  };

// ---------------------------------------------------------------------------------------------- AVX2
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#endif
namespace avx2 {

COHORT_DEFINE_PREFIXED_LANES(_mm256, si256, __m256, __m256d, __m256i, 32)

struct I64 : IntBase<int64_t> {
  static R add(R a, R b) { return _mm256_add_epi64(a, b); }
  static R mul(R a, R b) {  // (ah*2^32 + al)(bh*2^32 + bl) mod 2^64 = al*bl + (al*bh + ah*bl) << 32
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)),
                                     _mm256_mul_epu32(_mm256_srli_epi64(a, 32), b));
    return _mm256_add_epi64(_mm256_mul_epu32(a, b), _mm256_slli_epi64(cross, 32));
  }
  static R min(R a, R b) { return _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi64(a, b)); }
  static R max(R a, R b) { return _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi64(b, a)); }
};

// 16-bit floats: widened to 8 fp32 lanes, combined with the fp32 operations, rounded once on store.
struct F16 : F32 {
  using T = uint16_t;
  static R load(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(uint16_t* p, R v) {
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
    __m128i canonical = _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0x8000))),
                                     _mm_set1_epi16(0x7e00));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_blendv_epi8(h, canonical, nan16));
  }
};

// bfloat16's ISA-specific steps (COHORT_DEFINE_BF16 does the rest): widen 8 values to 32-bit lanes,
// pick b where v is NaN, and store the low 16 bits of each lane.
inline __m256i widen_u16(const uint16_t* p) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i select_nan(__m256 v, __m256i a, __m256i b) {
  return _mm256_blendv_epi8(a, b, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline void store_low_u16(uint16_t* p, __m256i r) {
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // qwords 0 and 2
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
COHORT_DEFINE_BF16(_mm256, si256)

COHORT_DEFINE_VECTOR_LOOPS

}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ------------------------------------------------------------------------------------------- AVX-512
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c")
#endif
namespace avx512 {

COHORT_DEFINE_PREFIXED_LANES(_mm512, si512, __m512, __m512d, __m512i, 64)

struct I64 : IntBase<int64_t> {
  static R add(R a, R b) { return _mm512_add_epi64(a, b); }
  static R mul(R a, R b) { return _mm512_mullo_epi64(a, b); }
  static R min(R a, R b) { return _mm512_min_epi64(a, b); }
  static R max(R a, R b) { return _mm512_max_epi64(a, b); }
};

struct F16 : F32 {
  using T = uint16_t;
  static R load(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(uint16_t* p, R v) {
    __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m256i canonical = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0x8000))),
                                        _mm256_set1_epi16(0x7e00));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_mask_blend_epi16(nan, h, canonical));
  }
};

inline __m512i widen_u16(const uint16_t* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i select_nan(__m512 v, __m512i a, __m512i b) {
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), a, b);
}
inline void store_low_u16(uint16_t* p, __m512i r) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
COHORT_DEFINE_BF16(_mm512, si512)

COHORT_DEFINE_VECTOR_LOOPS

}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

static const env::StringSetting kReduceKernels(
    "COHORT_REDUCE_KERNELS", "",
    "reduction kernel family: scalar, avx2 or avx512 (default: the best this CPU supports)");

KernelFamily choose_family() {
  if (auto forced = kReduceKernels.get(); !forced.empty()) {
    for (KernelFamily f : {KernelFamily::kScalar, KernelFamily::kAvx2, KernelFamily::kAvx512}) {
      if (forced == family_name(f)) {
        if (!family_supported(f))
          throw ConfigError("COHORT_REDUCE_KERNELS=" + forced + ": this CPU does not support " + forced);
        return f;
      }
    }
    throw ConfigError("COHORT_REDUCE_KERNELS=" + forced + ": expected scalar, avx2 or avx512");
  }
  if (family_supported(KernelFamily::kAvx512)) return KernelFamily::kAvx512;
  if (family_supported(KernelFamily::kAvx2)) return KernelFamily::kAvx2;
  return KernelFamily::kScalar;
}

}  // namespace

const char* family_name(KernelFamily f) {
  switch (f) {
    case KernelFamily::kScalar: return "scalar";
    case KernelFamily::kAvx2: return "avx2";
    case KernelFamily::kAvx512: return "avx512";
  }
  return "?";
}

bool family_supported(KernelFamily f) {
  switch (f) {
    case KernelFamily::kScalar: return true;
    case KernelFamily::kAvx2: return __builtin_cpu_supports("avx2") && cpu_has_f16c();
    case KernelFamily::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx2") && cpu_has_f16c();
  }
  return false;
}

KernelFamily active_family() {
  static const KernelFamily family = choose_family();
  return family;
}

void reduce_to_family(KernelFamily f, void* dst, const void* a, const void* b, size_t n, DataType t,
                      ReduceOp op) {
  size_t done = 0;
  if (f == KernelFamily::kAvx512) done = avx512::reduce(dst, a, b, n, t, op);
  else if (f == KernelFamily::kAvx2) done = avx2::reduce(dst, a, b, n, t, op);
  if (done == n) return;
  const size_t offset = done * dtype_size(t);
  reduce_to_scalar(static_cast<char*>(dst) + offset, static_cast<const char*>(a) + offset,
                   static_cast<const char*>(b) + offset, n - done, t, op);
}

void reduce_to(void* dst, const void* a, const void* b, size_t n, DataType t, ReduceOp op) {
  reduce_to_family(active_family(), dst, a, b, n, t, op);
}

void reduce_into(void* dst, const void* src, size_t n, DataType t, ReduceOp op) {
  reduce_to_family(active_family(), dst, dst, src, n, t, op);
}

void finish_average_family(KernelFamily f, void* data, size_t n, DataType t, int divisor) {
  size_t done = 0;
  if (f == KernelFamily::kAvx512) done = avx512::divide(data, n, t, divisor);
  else if (f == KernelFamily::kAvx2) done = avx2::divide(data, n, t, divisor);
  if (done == n) return;
  finish_average_scalar(static_cast<char*>(data) + done * dtype_size(t), n - done, t, divisor);
}

void finish_average(void* data, size_t n, DataType t, int divisor) {
  finish_average_family(active_family(), data, n, t, divisor);
}

const char* kernel_family() { return family_name(active_family()); }

}  // namespace cohort::kernels
