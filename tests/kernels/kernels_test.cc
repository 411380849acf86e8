// Every vectorised kernel family against the scalar reference, bit for bit: every dtype and op, lengths
// around the vector widths (odd ones too), misaligned pointers, aliasing (reduce_into), and the special
// values (infinities, NaN, signed zeros, subnormals, ties for rounding) of the floating types.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "collectives/reduce_kernels.h"
#include "collectives/reduce_kernels_impl.h"
#include "common/half.h"

namespace cohort::kernels {
namespace {

constexpr DataType kTypes[] = {DataType::kInt8,    DataType::kUInt8,    DataType::kInt32,   DataType::kInt64,
                               DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};

std::vector<KernelFamily> vector_families() {
  std::vector<KernelFamily> out;
  for (KernelFamily f : {KernelFamily::kAvx2, KernelFamily::kAvx512})
    if (family_supported(f)) out.push_back(f);
  return out;
}

bool is_nan(DataType t, const uint8_t* p) {
  switch (t) {
    case DataType::kFloat32: { float f; std::memcpy(&f, p, 4); return std::isnan(f); }
    case DataType::kFloat64: { double f; std::memcpy(&f, p, 8); return std::isnan(f); }
    case DataType::kFloat16: { uint16_t h; std::memcpy(&h, p, 2); return std::isnan(half_to_float(h)); }
    case DataType::kBFloat16: { uint16_t h; std::memcpy(&h, p, 2); return std::isnan(bf16_to_float(h)); }
    default: return false;
  }
}

// Fills `bytes` with values of type t. Integers span their whole range for 8-bit types and a moderate
// one for wider types (so that the reference's signed arithmetic never overflows); floats mix normal
// values with the special ones.
void fill(std::vector<uint8_t>& buf, DataType t, size_t n, std::mt19937_64& rng, bool specials) {
  buf.assign(n * dtype_size(t), 0);
  std::uniform_real_distribution<double> real(-100.0, 100.0);
  std::uniform_int_distribution<int64_t> wide(-3000000, 3000000);
  std::uniform_int_distribution<int> narrow(0, 255);
  std::uniform_int_distribution<int> pick(0, 15);
  const double special_values[] = {INFINITY, -INFINITY, 0.0, -0.0, 1e-40, -1e-41, 6e-8, 65504.0, 65520.0,
                                   3.0e38, 1.0 + 1.0 / 2048, 1.0 + 3.0 / 2048, std::nan("")};
  for (size_t i = 0; i < n; ++i) {
    double v = real(rng);
    if (specials && pick(rng) == 0) v = special_values[narrow(rng) % std::size(special_values)];
    uint8_t* p = buf.data() + i * dtype_size(t);
    switch (t) {
      case DataType::kInt8:
      case DataType::kUInt8: *p = static_cast<uint8_t>(narrow(rng)); break;
      case DataType::kInt32: { int32_t x = static_cast<int32_t>(wide(rng) % 40000); std::memcpy(p, &x, 4); break; }
      case DataType::kInt64: { int64_t x = wide(rng); std::memcpy(p, &x, 8); break; }
      case DataType::kFloat16: { uint16_t h = float_to_half(static_cast<float>(v)); std::memcpy(p, &h, 2); break; }
      case DataType::kBFloat16: { uint16_t h = float_to_bf16(static_cast<float>(v)); std::memcpy(p, &h, 2); break; }
      case DataType::kFloat32: { float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
      case DataType::kFloat64: { std::memcpy(p, &v, 8); break; }
    }
  }
}

// Bitwise comparison; a NaN only has to be a NaN where the reference has one (when both inputs are
// NaN, which operand's payload survives depends on the order the compiler put the scalar operands in).
void expect_same(DataType t, const uint8_t* got, const uint8_t* want, size_t n, const std::string& what) {
  const size_t es = dtype_size(t);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* g = got + i * es;
    const uint8_t* w = want + i * es;
    if (std::memcmp(g, w, es) == 0) continue;
    if (is_nan(t, w) && is_nan(t, g)) continue;
    uint64_t gv = 0, wv = 0;
    std::memcpy(&gv, g, es);
    std::memcpy(&wv, w, es);
    ADD_FAILURE() << what << ": element " << i << " of " << n << " is 0x" << std::hex << gv << ", reference 0x" << wv;
    return;
  }
}

class KernelFamilies : public ::testing::TestWithParam<KernelFamily> {};

TEST_P(KernelFamilies, MatchesScalarReferenceForEveryTypeOpAndLength) {
  const KernelFamily family = GetParam();
  std::mt19937_64 rng(42);
  const size_t lengths[] = {0, 1, 2, 3, 7, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 1000, 4099};
  for (DataType t : kTypes) {
    for (ReduceOp op : kOps) {
      if (!op_supported(t, op)) continue;
      for (size_t n : lengths) {
        for (size_t misalign : {size_t{0}, size_t{1}, size_t{3}}) {
          std::vector<uint8_t> a, b;
          fill(a, t, n, rng, /*specials=*/true);
          fill(b, t, n, rng, /*specials=*/true);
          const size_t bytes = n * dtype_size(t);
          // Misaligned copies: the kernels must not assume alignment (element alignment is kept for
          // misalign 0, broken on purpose otherwise: memcpy-based callers may hand any address).
          std::vector<uint8_t> sa(bytes + 8), sb(bytes + 8), sd(bytes + 8), want(bytes);
          if (bytes) {  // a.data() is null for n = 0, and memcpy's arguments must not be
            std::memcpy(sa.data() + misalign, a.data(), bytes);
            std::memcpy(sb.data() + misalign, b.data(), bytes);
          }
          reduce_to_scalar(want.data(), a.data(), b.data(), n, t, op);
          reduce_to_family(family, sd.data() + misalign, sa.data() + misalign, sb.data() + misalign, n, t, op);
          const std::string what = std::string(family_name(family)) + " " + std::string(dtype_name(t)) + " " +
                                   std::string(reduce_op_name(op)) + " n=" + std::to_string(n) +
                                   " misalign=" + std::to_string(misalign);
          expect_same(t, sd.data() + misalign, want.data(), n, what);
          // In place (dst aliases a), as reduce_into does.
          reduce_to_family(family, sa.data() + misalign, sa.data() + misalign, sb.data() + misalign, n, t, op);
          expect_same(t, sa.data() + misalign, want.data(), n, what + " in-place");
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST_P(KernelFamilies, HalfPrecisionRoundingTiesAndEveryInputPattern) {
  // All 65536 fp16 / bf16 bit patterns against a few partners: exercises subnormals, infinities,
  // NaN payloads and ties-to-even on the way back.
  const KernelFamily family = GetParam();
  std::vector<uint16_t> a(65536), b(65536), got(65536), want(65536);
  for (uint32_t i = 0; i < 65536; ++i) a[i] = static_cast<uint16_t>(i);
  for (DataType t : {DataType::kFloat16, DataType::kBFloat16}) {
    for (uint16_t partner : {uint16_t{0x0000}, uint16_t{0x8000}, uint16_t{0x3c00}, uint16_t{0x0001},
                             uint16_t{0x3f80}, uint16_t{0xbc01}}) {
      std::fill(b.begin(), b.end(), partner);
      for (ReduceOp op : kOps) {
        reduce_to_scalar(want.data(), a.data(), b.data(), a.size(), t, op);
        reduce_to_family(family, got.data(), a.data(), b.data(), a.size(), t, op);
        expect_same(t, reinterpret_cast<uint8_t*>(got.data()), reinterpret_cast<uint8_t*>(want.data()), a.size(),
                    std::string(family_name(family)) + " " + std::string(dtype_name(t)) + " " +
                        std::string(reduce_op_name(op)) + " partner " + std::to_string(partner));
      }
    }
  }
}

TEST_P(KernelFamilies, AverageMatchesScalarReference) {
  // kAvg's last step divides by the number of ranks: every float type, several divisors (powers of two
  // and not), lengths around the vector width, misaligned, with NaN/Inf/subnormal inputs; and every
  // fp16/bf16 bit pattern.
  const KernelFamily family = GetParam();
  std::mt19937_64 rng(7);
  for (DataType t : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16}) {
    for (int divisor : {1, 2, 3, 7, 8}) {
      for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{65}, size_t{1000}}) {
        for (size_t misalign : {size_t{0}, size_t{2}}) {
          std::vector<uint8_t> a;
          fill(a, t, n, rng, /*specials=*/true);
          const size_t bytes = n * dtype_size(t);
          std::vector<uint8_t> want(a), got(bytes + 8);
          if (bytes) std::memcpy(got.data() + misalign, a.data(), bytes);  // a.data() is null for n = 0
          finish_average_scalar(want.data(), n, t, divisor);
          finish_average_family(family, got.data() + misalign, n, t, divisor);
          expect_same(t, got.data() + misalign, want.data(), n,
                      std::string(family_name(family)) + " avg " + std::string(dtype_name(t)) + " /" +
                          std::to_string(divisor) + " n=" + std::to_string(n));
          if (HasFailure()) return;
        }
      }
    }
  }
  std::vector<uint16_t> all(65536), want(65536);
  for (DataType t : {DataType::kFloat16, DataType::kBFloat16}) {
    for (int divisor : {2, 3, 6}) {
      for (uint32_t i = 0; i < 65536; ++i) all[i] = want[i] = static_cast<uint16_t>(i);
      finish_average_scalar(want.data(), want.size(), t, divisor);
      finish_average_family(family, all.data(), all.size(), t, divisor);
      expect_same(t, reinterpret_cast<uint8_t*>(all.data()), reinterpret_cast<uint8_t*>(want.data()), all.size(),
                  std::string(family_name(family)) + " avg all patterns " + std::string(dtype_name(t)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Supported, KernelFamilies, ::testing::ValuesIn(vector_families()),
                         [](const auto& info) { return std::string(family_name(info.param)); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(KernelFamilies);

TEST(KernelDispatch, EntryPointsUseTheActiveFamilyAndAgreeWithReference) {
  EXPECT_STREQ(kernel_family(), family_name(active_family()));
  EXPECT_TRUE(family_supported(active_family()));
  std::vector<float> a(1001), b(1001), want(1001);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i) * 0.5f;
    b[i] = 3.0f - static_cast<float>(i);
  }
  reduce_to_scalar(want.data(), a.data(), b.data(), a.size(), DataType::kFloat32, ReduceOp::kSum);
  reduce_into(a.data(), b.data(), a.size(), DataType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(0, std::memcmp(a.data(), want.data(), a.size() * sizeof(float)));
}

}  // namespace
}  // namespace cohort::kernels
