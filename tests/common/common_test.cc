// Tests of the common layer: 16-bit float conversion, settings parsers, string helpers, and the
// in-memory store (the reference every other store is compared with).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>
#include <thread>

#include "cohort/error.h"
#include "common/affinity.h"
#include "common/copy.h"
#include "common/env.h"
#include "common/half.h"
#include "common/half_arrays.h"
#include "common/strings.h"
#include "store/memory_store.h"
#include "support/test_support.h"

namespace cohort {
namespace {

TEST(Half, RoundTripsEveryHalfValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_half(f), h) << "half bits " << h;
  }
}

TEST(Half, ArraysConvertLikeTheScalarFunctions) {
  // Every 16-bit pattern (float16 and bfloat16) to float32, and float32 patterns spread over the whole
  // range (with ties, subnormals, overflow, infinities and NaNs among them) to both; odd lengths reach
  // the scalar tails.
  std::vector<uint16_t> all(65536 + 3);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i * 0x9e37u + (i >> 16));
  std::vector<float> out(all.size());
  auto same_float = [](float a, float b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0; };
  half_to_floats(all.data(), out.data(), all.size());
  for (size_t i = 0; i < all.size(); ++i) ASSERT_TRUE(same_float(out[i], half_to_float(all[i]))) << "half " << all[i];
  bf16_to_floats(all.data(), out.data(), all.size());
  for (size_t i = 0; i < all.size(); ++i) ASSERT_TRUE(same_float(out[i], bf16_to_float(all[i]))) << "bf16 " << all[i];

  std::vector<float> floats;
  std::mt19937 rng(7);
  for (int i = 0; i < 200001; ++i) {
    uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, 4);
    floats.push_back(f);
  }
  for (float f : {0.0f, -0.0f, 1.0f + std::ldexp(1.0f, -11), 65520.0f, 65519.0f, std::ldexp(1.0f, -24),
                  std::ldexp(1.5f, -25), 1.0f + std::ldexp(1.0f, -8), std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
    floats.push_back(f);
  std::vector<uint16_t> h(floats.size());
  floats_to_half(floats.data(), h.data(), floats.size());
  for (size_t i = 0; i < floats.size(); ++i) {
    if (std::isnan(floats[i])) {
      ASSERT_TRUE(std::isnan(half_to_float(h[i]))) << i;
    } else {
      ASSERT_EQ(h[i], float_to_half(floats[i])) << "float " << floats[i];
    }
  }
  floats_to_bf16(floats.data(), h.data(), floats.size());
  for (size_t i = 0; i < floats.size(); ++i) ASSERT_EQ(h[i], float_to_bf16(floats[i])) << "float " << floats[i];
}

TEST(Half, RoundsToNearestEven) {
  // 1 + 2^-11 is exactly halfway between 1 and the next half (1 + 2^-10): ties go to even (1.0).
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3 * 2^-11 is halfway between 1+2^-10 (odd) and 1+2^-9 (even): rounds up.
  EXPECT_EQ(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);  // overflows to infinity
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25)), 0x0000);  // halfway to zero: even
}

TEST(BFloat16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie -> even
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}

TEST(Env, ParsesDurationsSizesAndBooleans) {
  EXPECT_DOUBLE_EQ(env::parse_seconds("X", "30"), 30.0);
  EXPECT_DOUBLE_EQ(env::parse_seconds("X", "500ms"), 0.5);
  EXPECT_DOUBLE_EQ(env::parse_seconds("X", "2m"), 120.0);
  EXPECT_EQ(env::parse_bytes("X", "64K"), 65536u);
  EXPECT_EQ(env::parse_bytes("X", "16M"), 16u << 20);
  EXPECT_TRUE(env::parse_bool("X", "yes"));
  EXPECT_FALSE(env::parse_bool("X", "0"));
  EXPECT_THROW(env::parse_seconds("COHORT_TIMEOUT", "soon"), ConfigError);
  try {
    env::parse_int("COHORT_N", "12x");
    FAIL() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "COHORT_N=12x: expected an integer");
  }
}

// `cohort env` prints defaults as a user writes them, and each reads back to the same value.
TEST(Env, DefaultsPrintAsAUserWritesThemAndReadBack) {
  EXPECT_EQ(env::format_seconds(300), "300 s");
  EXPECT_EQ(env::format_seconds(60), "60 s");
  EXPECT_EQ(env::format_seconds(0.002), "2 ms");
  EXPECT_EQ(env::format_seconds(0.5), "500 ms");
  EXPECT_EQ(env::format_seconds(7200), "2 h");
  EXPECT_EQ(env::format_seconds(0), "0 s");
  EXPECT_EQ(env::format_bytes(1 << 20), "1 MiB");
  EXPECT_EQ(env::format_bytes(256u << 10), "256 KiB");
  EXPECT_EQ(env::format_bytes(3ull << 30), "3 GiB");
  EXPECT_EQ(env::format_bytes(1000), "1000");
  for (double s : {300.0, 60.0, 0.002, 0.5, 7200.0, 2.5})
    EXPECT_DOUBLE_EQ(env::parse_seconds("X", env::format_seconds(s)), s);
  for (uint64_t b : {uint64_t{1} << 20, uint64_t{256} << 10, uint64_t{3} << 30, uint64_t{1000}})
    EXPECT_EQ(env::parse_bytes("X", env::format_bytes(b)), b);
  // What `cohort env` lists for the registered settings: no "60.000000".
  const env::SecondsSetting s("COHORT_TEST_SECONDS", 60.0, "a test");
  for (const auto& info : env::registered()) {
    if (info.name == "COHORT_TEST_SECONDS") {
      EXPECT_EQ(info.default_text, "60 s");
    }
  }
}

TEST(Affinity, WaitsYieldOnlyWhereTheRanksCpuSetsOverlap) {
  EXPECT_FALSE(affinity::allowed_cpus().empty());
  EXPECT_TRUE(affinity::disjoint({{0}, {1}}));
  EXPECT_TRUE(affinity::disjoint({{0, 1}, {2, 3}, {4}}));
  EXPECT_FALSE(affinity::disjoint({{0, 1}, {1, 2}}));  // CPU 1 is shared
  EXPECT_FALSE(affinity::disjoint({{0, 1}, {0, 1}}));  // unbound ranks: the same set
  EXPECT_FALSE(affinity::disjoint({{0}, {}}));         // a rank that did not say: assume it shares
  // COHORT_YIELD is unset here: auto.
  auto own = affinity::choose_yield({{0}, {1}});
  EXPECT_FALSE(own.yield);
  EXPECT_NE(own.why.find("CPUs of its own"), std::string::npos) << own.why;
  auto shared = affinity::choose_yield({{0, 1}, {0, 1}});
  EXPECT_TRUE(shared.yield);
  EXPECT_NE(shared.why.find("overlap"), std::string::npos) << shared.why;
  EXPECT_FALSE(affinity::choose_yield({{0, 1}}).yield) << "alone on this machine: nobody waits for its core";
}

TEST(Strings, IntListsAndRanges) {
  EXPECT_EQ(str::parse_int_list("0,2-4,7", "ranks"), (std::vector<int>{0, 2, 3, 4, 7}));
  EXPECT_THROW(str::parse_int_list("3-1", "ranks"), ConfigError);
  EXPECT_EQ(str::format_ranges({0, 1, 2, 3, 5, 7, 8, 9}), "0-3,5,7-9");
  EXPECT_EQ(str::split("a,,b", ','), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(str::trim("  x y \n"), "x y");
}

// The rank names in cohort's messages, found without std::regex (see strings.h).
TEST(Strings, RankMentionsAreTheRankWordsFollowedByAnOpeningParenthesis) {
  const std::string text = "lost rank 3 (hostB): rank 12 (h) failed; frank 4 (x), rank 5, rank (6), rank 7 (";
  auto m = str::rank_mentions(text);
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[0].rank, 3);
  EXPECT_EQ(text.substr(m[0].pos, m[0].len), "rank 3 (");
  EXPECT_EQ(m[1].rank, 12);
  EXPECT_EQ(text.substr(m[1].pos, m[1].len), "rank 12 (");
  EXPECT_EQ(m[2].rank, 7);
  EXPECT_TRUE(str::rank_mentions("rank 1 ").empty());
  EXPECT_TRUE(str::rank_mentions("").empty());
}

TEST(MemoryStore, OperationsAndWaits) {
  auto store = make_memory_store();
  store->set_timeout(std::chrono::milliseconds(200));
  store->set("a", "1");
  EXPECT_EQ(store->get("a"), "1");
  EXPECT_EQ(store->add("n", 5), 5);
  EXPECT_EQ(store->add("n", -2), 3);
  EXPECT_EQ(store->compare_set("c", "", "x"), "x");
  EXPECT_EQ(store->compare_set("c", "y", "z"), "x");
  EXPECT_EQ(store->compare_set("c", "x", "z"), "z");
  EXPECT_TRUE(store->remove("c"));
  EXPECT_FALSE(store->remove("c"));
  EXPECT_EQ(store->num_keys(), 2);
  store->multi_set({"k1", "k2"}, {"v1", "v2"});
  EXPECT_EQ(store->multi_get({"k2", "k1"}), (std::vector<std::string>{"v2", "v1"}));
  EXPECT_TRUE(store->check({"k1", "k2"}));
  EXPECT_FALSE(store->check({"k1", "nope"}));
  try {
    store->wait({"k1", "missing/rank/3"}, std::chrono::milliseconds(50));
    FAIL() << "no timeout";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("missing/rank/3"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("k1"), std::string::npos) << e.what();
  }
}

TEST(MemoryStore, BarrierNamesMissingRanks) {
  auto store = make_memory_store();
  test::run_ranks(4, [&](int rank) { store->barrier("b1", rank, 4, std::chrono::seconds(5)); });
  // Only ranks 0 and 2 arrive: both time out naming 1 and 3.
  test::run_ranks(2, [&](int i) {
    try {
      store->barrier("b2", i * 2, 4, std::chrono::milliseconds(100));
      ADD_FAILURE() << "barrier passed with ranks missing";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("missing rank(s) 1,3"), std::string::npos) << e.what();
    }
  });
}

TEST(PrefixStore, KeepsNamespacesApart) {
  auto base = make_memory_store();
  auto a = make_prefix_store(base, "job1");
  auto b = make_prefix_store(base, "job2");
  a->set("k", "a");
  b->set("k", "b");
  EXPECT_EQ(a->get("k"), "a");
  EXPECT_EQ(b->get("k"), "b");
  EXPECT_EQ(base->get("job1/k"), "a");
}


// Streaming stores need 16-byte aligned destinations: every alignment of both ends, sizes around the
// 64-byte body, and a large copy, between guard bytes that must survive.
TEST(Copy, StreamingCopiesEveryByteAtEveryAlignmentAndNothingElse) {
  std::vector<unsigned char> src(70000), dst(70000 + 256);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  auto check = [&](size_t dst_at, size_t src_at, size_t bytes) {
    std::fill(dst.begin(), dst.end(), 0xEE);
    copy::copy_streaming(dst.data() + dst_at, src.data() + src_at, bytes);
    ASSERT_EQ(std::memcmp(dst.data() + dst_at, src.data() + src_at, bytes), 0)
        << "dst+" << dst_at << " src+" << src_at << " bytes " << bytes;
    for (size_t i = 0; i < dst_at; ++i) ASSERT_EQ(dst[i], 0xEE) << "wrote before the start: " << dst_at << "," << bytes;
    for (size_t i = dst_at + bytes; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE) << "wrote past the end: " << bytes;
  };
  for (size_t dst_at = 0; dst_at < 20; ++dst_at)
    for (size_t src_at = 0; src_at < 5; ++src_at)
      for (size_t bytes : {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 200, 1000}) check(dst_at, src_at, bytes);
  check(3, 1, 65536 + 77);
  check(0, 0, 65536);
}

}  // namespace
}  // namespace cohort
