// shm::Group correctness: every collective, world sizes 1..8, every dtype and op, odd sizes, chunked
// pipelines (tiny slots so that a few KiB already cross many chunks). Ranks run as threads (the segment
// is shared the same way within one process) and, in the process tests, as forked processes; the
// fault test SIGKILLs a rank in the middle of allreduces and checks the others fail within 2 s and that
// nothing is left behind in /dev/shm.
#include <sched.h>

#include <gtest/gtest.h>

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cohort/error.h"
#include "collectives/reduce_kernels.h"
#include "collectives/reduce_kernels_impl.h"
#include "collectives/shm/group.h"
#include "common/half.h"
#include "store/memory_store.h"
#include "support/fork_ranks.h"
#include "support/test_support.h"

namespace cohort::shm {
namespace {

// memcmp == 0, for any size: memcmp's pointers must not be null even for 0 bytes (an empty vector's are).
bool equal_bytes(const void* a, const void* b, size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

using std::chrono::milliseconds;

constexpr DataType kTypes[] = {DataType::kInt8,    DataType::kUInt8,    DataType::kInt32,   DataType::kInt64,
                               DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};

// Small slots: a 4 KiB slot and 256 B "small" limit make every algorithm run many chunks at test sizes.
GroupOptions tiny_options() { return GroupOptions{4096, 256, std::chrono::microseconds(20)}; }

// Deterministic per-rank data: small values, so products of up to 8 ranks stay exact in every type.
std::vector<uint8_t> make_input(DataType t, size_t n, int rank, uint64_t salt) {
  std::vector<uint8_t> buf(n * dtype_size(t));
  std::mt19937_64 rng(salt * 1000 + static_cast<uint64_t>(rank));
  std::uniform_int_distribution<int> small(-3, 3);
  for (size_t i = 0; i < n; ++i) {
    int v = small(rng);
    uint8_t* p = buf.data() + i * dtype_size(t);
    switch (t) {
      case DataType::kInt8: { int8_t x = static_cast<int8_t>(v); std::memcpy(p, &x, 1); break; }
      case DataType::kUInt8: { uint8_t x = static_cast<uint8_t>(v + 3); std::memcpy(p, &x, 1); break; }
      case DataType::kInt32: { int32_t x = v; std::memcpy(p, &x, 4); break; }
      case DataType::kInt64: { int64_t x = v; std::memcpy(p, &x, 8); break; }
      case DataType::kFloat16: { uint16_t x = float_to_half(v * 0.375f); std::memcpy(p, &x, 2); break; }
      case DataType::kBFloat16: { uint16_t x = float_to_bf16(v * 0.375f); std::memcpy(p, &x, 2); break; }
      case DataType::kFloat32: { float x = v * 0.1f; std::memcpy(p, &x, 4); break; }
      case DataType::kFloat64: { double x = v * 0.1; std::memcpy(p, &x, 8); break; }
    }
  }
  return buf;
}

// The reference: the scalar kernel applied in rank order, then the average's division.
std::vector<uint8_t> expected_reduction(DataType t, ReduceOp op, size_t n, int world, uint64_t salt) {
  std::vector<uint8_t> acc = make_input(t, n, 0, salt);
  for (int r = 1; r < world; ++r) {
    auto x = make_input(t, n, r, salt);
    kernels::reduce_to_scalar(acc.data(), acc.data(), x.data(), n, t, op);
  }
  if (op == ReduceOp::kAvg && world > 1) kernels::finish_average(acc.data(), n, t, world);
  return acc;
}

std::string label(DataType t, ReduceOp op, size_t n, int world, int rank) {
  return std::string(dtype_name(t)) + " " + std::string(reduce_op_name(op)) + " n=" + std::to_string(n) +
         " world=" + std::to_string(world) + " rank=" + std::to_string(rank);
}

std::vector<std::unique_ptr<Group>> make_groups(int world, const GroupOptions& opt) {
  std::vector<std::unique_ptr<Group>> groups(static_cast<size_t>(world));
  const std::string address = random_address("test");
  test::run_ranks(world, [&](int r) { groups[r] = Group::create_at(address, r, world, milliseconds(20000), opt); });
  return groups;
}

// World size, and the copy into the slots (both ways must give the same bits).
class ShmGroupWorld : public ::testing::TestWithParam<std::tuple<int, SlotCopy>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  GroupOptions options() const {
    GroupOptions o = tiny_options();
    o.slot_copy = slot_copy_name(std::get<1>(GetParam()));
    return o;
  }
};

TEST_P(ShmGroupWorld, AllreduceEveryTypeAndOpMatchesRankOrderReference) {
  const int world = this->world();
  auto groups = make_groups(world, options());
  for (int r = 0; r < world; ++r) ASSERT_EQ(groups[r]->slot_copy(), std::get<1>(GetParam())) << "rank " << r;
  // 0, 1, odd, just above "small", several chunks with a ragged end.
  const size_t counts[] = {0, 1, 7, 129, 3001};
  test::run_ranks(world, [&](int r) {
    uint64_t salt = 0;
    for (DataType t : kTypes) {
      for (ReduceOp op : kOps) {
        if (!op_supported(t, op)) continue;
        for (size_t n : counts) {
          ++salt;
          auto want = expected_reduction(t, op, n, world, salt);
          auto in = make_input(t, n, r, salt);
          std::vector<uint8_t> out(in.size() + 1, 0xAB);  // +1: a guard byte that must survive
          groups[r]->allreduce(in.data(), out.data(), n, t, op);
          ASSERT_TRUE(equal_bytes(out.data(), want.data(), want.size())) << label(t, op, n, world, r);
          ASSERT_EQ(0xAB, out.back()) << "wrote past the end: " << label(t, op, n, world, r);
          // In place.
          groups[r]->allreduce(in.data(), in.data(), n, t, op);
          ASSERT_TRUE(equal_bytes(in.data(), want.data(), want.size())) << "in place: " << label(t, op, n, world, r);
        }
      }
    }
  });
}

TEST_P(ShmGroupWorld, ReduceScatterAllgatherBroadcastBarrier) {
  const int world = this->world();
  auto groups = make_groups(world, options());
  test::run_ranks(world, [&](int r) {
    uint64_t salt = 1000;
    for (size_t n : {size_t{1}, size_t{5}, size_t{700}, size_t{2500}}) {
      for (DataType t : {DataType::kFloat32, DataType::kBFloat16, DataType::kInt64, DataType::kUInt8}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
          ++salt;
          // reduce_scatter: input = world blocks of n; expected block r of the full reduction.
          auto want_all = expected_reduction(t, op, n * static_cast<size_t>(world), world, salt);
          auto in = make_input(t, n * static_cast<size_t>(world), r, salt);
          std::vector<uint8_t> out(n * dtype_size(t));
          groups[r]->reduce_scatter(in.data(), out.data(), n, t, op);
          ASSERT_TRUE(equal_bytes(out.data(), want_all.data() + static_cast<size_t>(r) * out.size(), out.size()))
              << "reduce_scatter " << label(t, op, n, world, r);
          // In place: output is our own block of the input.
          groups[r]->reduce_scatter(in.data(), in.data() + static_cast<size_t>(r) * out.size(), n, t, op);
          ASSERT_TRUE(equal_bytes(in.data() + static_cast<size_t>(r) * out.size(),
                                   want_all.data() + static_cast<size_t>(r) * out.size(), out.size()))
              << "reduce_scatter in place " << label(t, op, n, world, r);
          // cohort's in-place form (include/cohort/communicator.h): in == out, the result in the first block.
          auto whole = make_input(t, n * static_cast<size_t>(world), r, salt);
          groups[r]->reduce_scatter(whole.data(), whole.data(), n, t, op);
          ASSERT_TRUE(equal_bytes(whole.data(), want_all.data() + static_cast<size_t>(r) * out.size(), out.size()))
              << "reduce_scatter in place, result first " << label(t, op, n, world, r);
        }
      }
      // allgather of n*3+1 bytes per rank (odd), separate and in place.
      const size_t bytes = n * 3 + 1;
      std::vector<uint8_t> mine(bytes), all(bytes * static_cast<size_t>(world)), want(all.size());
      for (int q = 0; q < world; ++q)
        for (size_t i = 0; i < bytes; ++i) want[q * bytes + i] = static_cast<uint8_t>(q * 31 + i * 7 + n);
      std::memcpy(mine.data(), want.data() + static_cast<size_t>(r) * bytes, bytes);
      groups[r]->allgather(mine.data(), all.data(), bytes);
      ASSERT_EQ(all, want) << "allgather n=" << n << " rank " << r;
      std::vector<uint8_t> inplace(all.size(), 0);
      std::memcpy(inplace.data() + static_cast<size_t>(r) * bytes, mine.data(), bytes);
      groups[r]->allgather(inplace.data() + static_cast<size_t>(r) * bytes, inplace.data(), bytes);
      ASSERT_EQ(inplace, want) << "allgather in place n=" << n << " rank " << r;
      // cohort's in-place form: in == out, the contribution already at its block.
      std::vector<uint8_t> same(all.size(), 0);
      std::memcpy(same.data() + static_cast<size_t>(r) * bytes, mine.data(), bytes);
      groups[r]->allgather(same.data(), same.data(), bytes);
      ASSERT_EQ(same, want) << "allgather in place (in == out) n=" << n << " rank " << r;
      // broadcast from every root.
      for (int root = 0; root < world; ++root) {
        std::vector<uint8_t> buf(bytes * 5, static_cast<uint8_t>(r == root ? 0 : 0xEE));
        if (r == root)
          for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 13 + root);
        groups[r]->broadcast(buf.data(), buf.size(), root);
        for (size_t i = 0; i < buf.size(); ++i)
          ASSERT_EQ(buf[i], static_cast<uint8_t>(i * 13 + root)) << "broadcast root " << root << " rank " << r;
      }
      groups[r]->barrier();
    }
  });
}

TEST_P(ShmGroupWorld, AllreduceInPlaceOnSharedMemoryMatchesTheReferenceAndTouchesOnlyItsRange) {
  const int world = this->world();
  auto groups = make_groups(world, options());
  // Above the small limit (256 B), and long enough for several 64 KiB pieces per slice.
  const size_t counts[] = {129, 3001, 70001};
  const size_t capacity = 80000 * 8 + 256;
  test::run_ranks(world, [&](int r) {
    std::shared_ptr<void> memory = groups[r]->allocate_shared(capacity);
    char* base = static_cast<char*>(memory.get());
    uint64_t salt = 5000;
    for (DataType t : {DataType::kFloat32, DataType::kBFloat16, DataType::kInt64, DataType::kFloat64}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kProd}) {
        if (!op_supported(t, op)) continue;
        for (size_t n : counts) {
          ++salt;
          auto want = expected_reduction(t, op, n, world, salt);
          auto in = make_input(t, n, r, salt);
          // A range that starts 64 bytes in, between guard bytes that must survive on every rank.
          std::memset(base, 0x5C, capacity);
          char* range = base + 64;
          std::memcpy(range, in.data(), in.size());
          groups[r]->barrier();  // no peer may still be writing this rank's memory from the last call
          const uint64_t before = groups[r]->shared_allreduces();
          groups[r]->allreduce(range, range, n, t, op);
          // The in-place path ran (staging gives the same values, so this is what proves it).
          ASSERT_EQ(groups[r]->shared_allreduces(), before + (world > 1 ? 1 : 0)) << label(t, op, n, world, r);
          ASSERT_TRUE(equal_bytes(range, want.data(), want.size())) << "shared: " << label(t, op, n, world, r);
          ASSERT_EQ(0x5C, static_cast<unsigned char>(base[63])) << label(t, op, n, world, r);
          ASSERT_EQ(0x5C, static_cast<unsigned char>(range[in.size()])) << label(t, op, n, world, r);
          groups[r]->barrier();
        }
      }
    }
  });
}

TEST_P(ShmGroupWorld, AllreduceUpdateReducesAndUpdatesEveryElementOnceIntoEveryRanksParameters) {
  const int world = this->world();
  auto groups = make_groups(world, options());
  // Several 32 KiB pieces per slice, and counts that do not divide by the world.
  const size_t counts[] = {1, 129, 70001};
  const size_t capacity = 70001 * sizeof(float) + 256;
  std::vector<std::atomic<int>> updated(70001);
  test::run_ranks(world, [&](int r) {
    auto grad_memory = groups[r]->allocate_shared(capacity);
    auto param_memory = groups[r]->allocate_shared(capacity);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      for (size_t n : counts) {
        // Ranges 64 bytes in, between guard bytes that must survive on every rank.
        char* gbase = static_cast<char*>(grad_memory.get());
        char* pbase = static_cast<char*>(param_memory.get());
        std::memset(gbase, 0x5C, capacity);
        std::memset(pbase, 0x5C, capacity);
        float* grads = reinterpret_cast<float*>(gbase + 64);
        float* params = reinterpret_cast<float*>(pbase + 64);
        for (size_t i = 0; i < n; ++i) {
          grads[i] = static_cast<float>(r + 1) * 0.25f + static_cast<float>(i % 13) * 0.5f;
          params[i] = static_cast<float>(i % 7);
        }
        if (r == 0)
          for (size_t i = 0; i < n; ++i) updated[i] = 0;
        groups[r]->barrier();  // no peer still writes this rank's memory, and the counters are reset
        const uint64_t before = groups[r]->fused_updates();
        // SGD with lr 0.5: every element's update runs exactly once, on one rank.
        ASSERT_TRUE(groups[r]->allreduce_update(grads, params, n, op,
                                                [&](size_t offset, size_t m, const float* reduced, float* p) {
                                                  for (size_t i = 0; i < m; ++i) {
                                                    p[i] -= 0.5f * reduced[i];
                                                    ++updated[offset + i];
                                                  }
                                                }));
        EXPECT_EQ(groups[r]->fused_updates(), before + (world > 1 ? 1 : 0)) << label(DataType::kFloat32, op, n, world, r);
        for (size_t i = 0; i < n; ++i) {
          float sum = 0;
          for (int q = 0; q < world; ++q) sum += static_cast<float>(q + 1) * 0.25f + static_cast<float>(i % 13) * 0.5f;
          const float reduced = op == ReduceOp::kAvg ? sum / static_cast<float>(world) : sum;
          const float want = static_cast<float>(i % 7) - 0.5f * reduced;
          ASSERT_NEAR(params[i], want, 1e-5f) << "element " << i << " " << label(DataType::kFloat32, op, n, world, r);
          // The gradients stay this rank's own.
          ASSERT_EQ(grads[i], static_cast<float>(r + 1) * 0.25f + static_cast<float>(i % 13) * 0.5f) << i;
        }
        ASSERT_EQ(0x5C, static_cast<unsigned char>(pbase[63]));
        ASSERT_EQ(0x5C, static_cast<unsigned char>(pbase[64 + n * sizeof(float)]));
        ASSERT_EQ(0x5C, static_cast<unsigned char>(gbase[64 + n * sizeof(float)]));
        groups[r]->barrier();
        if (r == 0) {
          for (size_t i = 0; i < n; ++i) ASSERT_EQ(updated[i].load(), 1) << "element " << i << " world " << world;
        }
        groups[r]->barrier();
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmGroupWorld,
                         ::testing::Combine(::testing::Range(1, 9),
                                            ::testing::Values(SlotCopy::kCached, SlotCopy::kStreaming)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks_" +
                                  slot_copy_name(std::get<1>(info.param));
                         });

TEST(ShmGroup, OnlyInPlaceCallsAboveTheSmallLimitOnSharedMemoryTakeTheInPlacePath) {
  auto groups = make_groups(2, tiny_options());
  test::run_ranks(2, [&](int r) {
    auto memory = groups[r]->allocate_shared(1 << 16);
    float* shared = static_cast<float*>(memory.get());
    std::vector<float> ordinary(1000, 1.0f), out(1000);
    std::fill_n(shared, 1000, 1.0f);
    groups[r]->allreduce(ordinary.data(), ordinary.data(), 1000, DataType::kFloat32, ReduceOp::kSum);
    groups[r]->allreduce(shared, out.data(), 1000, DataType::kFloat32, ReduceOp::kSum);  // not in place
    groups[r]->allreduce(shared, shared, 16, DataType::kFloat32, ReduceOp::kSum);        // 64 B: small path
    EXPECT_EQ(groups[r]->shared_allreduces(), 0u);
    EXPECT_EQ(out[999], 2.0f);
    groups[r]->barrier();
    groups[r]->allreduce(shared, shared, 1000, DataType::kFloat32, ReduceOp::kSum);
    EXPECT_EQ(groups[r]->shared_allreduces(), 1u);
    EXPECT_EQ(shared[999], 2.0f);
  });
}

TEST(ShmGroup, AllreduceUpdateNeedsBothBuffersOnSharedMemoryAndTheSameRangesOnEveryRank) {
  auto groups = make_groups(2, tiny_options());
  test::run_ranks(2, [&](int r) {
    auto grads = groups[r]->allocate_shared(1 << 16);
    auto params = groups[r]->allocate_shared(1 << 16);
    std::vector<float> ordinary(1000, 1.0f);
    float* g = static_cast<float*>(grads.get());
    float* p = static_cast<float*>(params.get());
    auto sgd = [](size_t, size_t n, const float* reduced, float* w) {
      for (size_t i = 0; i < n; ++i) w[i] -= reduced[i];
    };
    // Ordinary memory on either side: not the fused path, and nothing happened (no round either).
    EXPECT_FALSE(groups[r]->allreduce_update(g, ordinary.data(), 1000, ReduceOp::kSum, sgd));
    EXPECT_FALSE(groups[r]->allreduce_update(ordinary.data(), p, 1000, ReduceOp::kSum, sgd));
    EXPECT_EQ(ordinary[0], 1.0f);
    EXPECT_THROW(groups[r]->allreduce_update(g, p, 1000, ReduceOp::kMax, sgd), InvalidArgument);
    // Parameters 16 floats further in on rank 1: its peer would write them at the wrong place.
    try {
      groups[r]->allreduce_update(g, p + (r == 0 ? 0 : 16), 1000, ReduceOp::kSum, sgd);
      ADD_FAILURE() << "rank " << r << ": allreduce_update on different ranges returned";
    } catch (const MismatchError& e) {
      EXPECT_NE(std::string(e.what()).find("allocate_shared"), std::string::npos) << e.what();
    }
  });
}

TEST(ShmGroup, SharedMemoryRangesThatDifferBetweenRanksAreAMismatch) {
  auto groups = make_groups(2, tiny_options());
  test::run_ranks(2, [&](int r) {
    auto memory = groups[r]->allocate_shared(1 << 16);
    float* data = static_cast<float*>(memory.get());
    // Rank 1 reduces a range 16 floats further in than rank 0's: neither may write the other's memory.
    float* range = data + (r == 0 ? 0 : 16);
    try {
      groups[r]->allreduce(range, range, 1000, DataType::kFloat32, ReduceOp::kSum);
      ADD_FAILURE() << "rank " << r << ": allreduce on different ranges returned";
    } catch (const MismatchError& e) {
      EXPECT_NE(std::string(e.what()).find("allocate_shared"), std::string::npos) << e.what();
    }
  });
}

TEST(ShmGroup, SharedMemoryAgainstOrdinaryMemoryIsAMismatch) {
  auto groups = make_groups(2, tiny_options());
  test::run_ranks(2, [&](int r) {
    auto memory = groups[r]->allocate_shared(1 << 16);
    std::vector<float> ordinary(1000, 1.0f);
    float* range = r == 0 ? static_cast<float*>(memory.get()) : ordinary.data();
    EXPECT_THROW(groups[r]->allreduce(range, range, 1000, DataType::kFloat32, ReduceOp::kSum), MismatchError);
  });
}

// allreduce_shareable (the PyTorch backend's allreduce): the ranks may pass shared memory or not, each
// on its own. In place only when all pass the same range; staged, with the right result and no error,
// when they differ; and shared memory handed out only when every rank asks for it.
TEST(ShmGroup, ShareableAllreduceRunsInPlaceOnlyOnTheSameRangeEverywhereAndStagesOtherwise) {
  constexpr int kWorld = 3;
  auto groups = make_groups(kWorld, tiny_options());
  test::run_ranks(kWorld, [&](int r) {
    Group& g = *groups[r];
    auto memory = g.allocate_shared(1 << 16);
    float* shared = static_cast<float*>(memory.get());
    std::vector<float> ordinary(1000);
    const float expected = 1.0f + 2.0f + 3.0f;
    auto reduce = [&](float* buf) {
      std::fill_n(buf, 1000, float(r + 1));
      EXPECT_EQ(g.allreduce_shareable(buf, 1000, DataType::kFloat32, ReduceOp::kSum, false), nullptr);
      EXPECT_EQ(buf[0], expected);
      EXPECT_EQ(buf[999], expected);
    };
    reduce(shared);  // the same range everywhere: in place
    EXPECT_EQ(g.shared_allreduces(), 1u);
    reduce(r == 1 ? ordinary.data() : shared);  // one rank on ordinary memory: staged
    reduce(shared + (r == 2 ? 16 : 0));         // one rank 16 floats further in: staged
    EXPECT_EQ(g.shared_allreduces(), 1u);
    reduce(shared);
    EXPECT_EQ(g.shared_allreduces(), 2u);
    g.barrier();  // the group is still in step
  });
}

TEST(ShmGroup, ShareableAllreduceHandsOutSharedMemoryOnlyWhenEveryRankAsks) {
  auto groups = make_groups(2, tiny_options());
  test::run_ranks(2, [&](int r) {
    Group& g = *groups[r];
    std::vector<float> buf(1000, float(r + 1));
    // Only rank 1 asks: nobody gets memory.
    EXPECT_EQ(g.allreduce_shareable(buf.data(), 1000, DataType::kFloat32, ReduceOp::kSum, r == 1), nullptr);
    // Both ask, but the call is at the small limit (it could never run in place): nobody gets memory.
    EXPECT_EQ(g.allreduce_shareable(buf.data(), 64, DataType::kFloat32, ReduceOp::kSum, true), nullptr);
    // Both ask: both get memory, after the reduction, which still went into their own buffers.
    std::fill(buf.begin(), buf.end(), float(r + 1));
    std::shared_ptr<void> memory = g.allreduce_shareable(buf.data(), 1000, DataType::kFloat32, ReduceOp::kSum, true);
    ASSERT_NE(memory, nullptr);
    EXPECT_EQ(buf[999], 3.0f);
    // The caller moves its buffer there: from then on its calls run in place, and asking again
    // (ranks whose moved buffers no longer line up would move again) allocates nothing.
    float* moved = static_cast<float*>(memory.get());
    std::fill_n(moved, 1000, float(r + 1));
    EXPECT_EQ(g.allreduce_shareable(moved, 1000, DataType::kFloat32, ReduceOp::kSum, true), nullptr);
    EXPECT_EQ(g.shared_allreduces(), 1u);
    EXPECT_EQ(moved[999], 3.0f);
  });
}

TEST(ShmGroup, SharedMemoryOutlivesItsGroupAndIsZeroed) {
  std::vector<std::shared_ptr<void>> memory(2);
  {
    auto groups = make_groups(2, tiny_options());
    test::run_ranks(2, [&](int r) { memory[r] = groups[r]->allocate_shared(100000); });
  }
  for (auto& m : memory) {
    const char* p = static_cast<const char*>(m.get());
    for (size_t i = 0; i < 100000; i += 997) ASSERT_EQ(0, p[i]);
    std::memset(m.get(), 1, 100000);  // still mapped and writable
  }
}

// The resident size of the mapping that starts at `base`, from /proc/self/smaps (0 if none does).
size_t resident_bytes_of_mapping(const void* base) {
  std::FILE* f = std::fopen("/proc/self/smaps", "r");
  if (!f) return 0;
  char line[512];
  bool in_it = false;
  size_t kb = 0;
  while (std::fgets(line, sizeof line, f)) {
    unsigned long start = 0, end = 0;
    if (std::sscanf(line, "%lx-%lx ", &start, &end) == 2 && std::strchr(line, ':') && !std::strstr(line, "kB")) {
      in_it = start == reinterpret_cast<uintptr_t>(base);
    } else if (in_it && std::sscanf(line, "Rss: %zu kB", &kb) == 1) {
      break;
    }
  }
  std::fclose(f);
  return kb * 1024;
}

// Each rank faults in only its own part of an allocate_shared segment: a rank's RSS must show its own
// buffer, not every rank's (with N local ranks that was N times the model's gradients per rank).
TEST(ShmGroup, SharedMemoryIsResidentInEachRankOnlyForItsOwnPartUntilItTouchesAnother) {
  const int world = 3;
  const size_t bytes = 4u << 20;
  auto groups = make_groups(world, tiny_options());
  std::vector<std::shared_ptr<void>> memory(world);
  test::run_ranks(world, [&](int r) { memory[r] = groups[r]->allocate_shared(bytes); });
  // Parts are page-rounded and in rank order: rank r's mapping starts r parts before its own part.
  const size_t part = bytes;  // a multiple of the page size already
  for (int r = 0; r < world; ++r) {
    const char* base = static_cast<const char*>(memory[r].get()) - static_cast<size_t>(r) * part;
    const size_t rss = resident_bytes_of_mapping(base);
    EXPECT_GE(rss, part) << "rank " << r << ": its own part is not resident";
    EXPECT_LT(rss, part + part / 2) << "rank " << r << ": other ranks' parts were faulted in too";
  }
  // Rank 0 reads rank 1's part through its own mapping: those pages join rank 0's RSS, and hold what
  // rank 1 wrote.
  std::memset(memory[1].get(), 7, bytes);
  const char* base0 = static_cast<const char*>(memory[0].get());
  for (size_t i = 0; i < bytes; i += 4096) ASSERT_EQ(7, base0[part + i]) << i;
  EXPECT_GE(resident_bytes_of_mapping(base0), 2 * part);
}

TEST(ShmGroup, CreateThroughStoreWithDefaultOptionsAndLargeBuffers) {
  // The store path and the default (env) options: 1 MiB slots, multi-chunk allreduce of ~5 MiB.
  auto store = make_memory_store();
  const int world = 3;
  const size_t n = (5u << 20) / 4 + 3;
  std::vector<std::unique_ptr<Group>> groups(world);
  test::run_ranks(world, [&](int r) {
    groups[r] = Group::create(*store, r, world, "job-large", milliseconds(20000));
    std::vector<float> buf(n);
    for (size_t i = 0; i < n; ++i) buf[i] = static_cast<float>((i % 1000) * (r + 1));
    groups[r]->allreduce(buf.data(), buf.data(), n, DataType::kFloat32, ReduceOp::kSum);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(buf[i], static_cast<float>((i % 1000) * 6)) << "element " << i;
  });
}

TEST(ShmGroup, TheLinkProbeGivesEveryRankEveryRanksFiguresAndLeavesTheSlotsUsable) {
  for (int world : {1, 2, 3}) {
    auto groups = make_groups(world, tiny_options());
    std::vector<std::vector<LinkProbe>> seen(static_cast<size_t>(world));
    test::run_ranks(world, [&](int r) {
      seen[size_t(r)] = groups[r]->probe();
      // The probe ran rounds of the slot protocol: the next collectives must still be right.
      const size_t n = 3 * tiny_options().slot_bytes / 4 + 5;  // several chunks
      std::vector<float> x(n);
      for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 13 + r);
      groups[r]->allreduce(x.data(), x.data(), n, DataType::kFloat32, ReduceOp::kSum);
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(x[i], static_cast<float>(world * (i % 13) + world * (world - 1) / 2)) << i;
    });
    for (int r = 0; r < world; ++r) {
      const auto& probes = seen[size_t(r)];
      ASSERT_EQ(probes.size(), size_t(world));
      for (int q = 0; q < world; ++q) {
        const LinkProbe& p = probes[size_t(q)];
        // Every rank holds the same figures for rank q: they came from rank q's slot.
        EXPECT_EQ(std::memcmp(&p, &seen[size_t(q)][size_t(q)], sizeof p), 0) << "rank " << r << "'s copy of " << q;
        EXPECT_GE(p.cpu, 0);
        EXPECT_EQ(p.probe_bytes, std::min<size_t>(tiny_options().slot_bytes, 256 << 10));
        if (world > 1) {
          EXPECT_GT(p.round_ns, 0.f);
          EXPECT_GT(p.peer_copy_gbps, 0.f);
          EXPECT_GT(p.own_copy_gbps, 0.f);
          EXPECT_GT(p.cached_write_gbps, 0.f);
          EXPECT_GT(p.streaming_write_gbps, 0.f);
          EXPECT_GT(p.streaming_read_gbps, 0.f);
        }
      }
    }
    const std::string line = Group::describe(seen[0]);
    if (world == 1) EXPECT_NE(line.find("no link"), std::string::npos) << line;
    else EXPECT_NE(line.find("another rank just wrote"), std::string::npos) << line;
    // The probe chose the slots' copy from the figures every rank holds: the same choice everywhere,
    // and the one choose_slot_copy gives for them.
    const SlotCopyChoice want = choose_slot_copy(seen[0], "auto");
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(groups[r]->slot_copy(), want.copy) << "rank " << r;
      EXPECT_NE(groups[r]->link_line().find("slots: " + want.why), std::string::npos) << groups[r]->link_line();
    }
  }
}

// The figures of two links: one where cache-to-cache copies are quick (this guest's, 2026-11-25) and
// one where they are slow, as issue 22's guest was suspected to be in its slow runs.
LinkProbe figures(float cached_write, float cached_read, float streaming_write, float streaming_read) {
  LinkProbe p;
  p.cpu = 0;
  p.cached_write_gbps = cached_write;
  p.peer_copy_gbps = cached_read;
  p.streaming_write_gbps = streaming_write;
  p.streaming_read_gbps = streaming_read;
  return p;
}

TEST(ShmSlotCopy, TheProbeFiguresChooseTheCheaperWayAndStreamingMustWinClearly) {
  // This guest: cached 19 + 19 GB/s, streaming 5 + 11: cached.
  const std::vector<LinkProbe> quick{figures(19, 19.3f, 5, 11), figures(19.5f, 19.4f, 5.1f, 10.8f)};
  SlotCopyChoice c = choose_slot_copy(quick, "auto");
  EXPECT_EQ(c.copy, SlotCopy::kCached) << c.why;
  EXPECT_NE(c.why.find("cached"), std::string::npos) << c.why;
  // Slow cache to cache (2 GB/s), memory fast: streaming.
  const std::vector<LinkProbe> slow{figures(19, 2, 12, 10), figures(19, 2.2f, 12, 10)};
  c = choose_slot_copy(slow, "auto");
  EXPECT_EQ(c.copy, SlotCopy::kStreaming) << c.why;
  EXPECT_EQ(c.why.rfind("streaming", 0), 0u) << c.why;
  // Streaming 10 % cheaper only: not enough to switch (a 256 KiB probe is not that precise).
  // cached: 1/10 + 1/10 = 0.2 s/GB; streaming: 1/11 + 1/11 = 0.18.
  EXPECT_EQ(choose_slot_copy({figures(10, 10, 11, 11), figures(10, 10, 11, 11)}, "auto").copy, SlotCopy::kCached);
  // The setting wins over the figures; no figures (one rank, or COHORT_SHM_PROBE=0 peers) mean cached.
  EXPECT_EQ(choose_slot_copy(slow, "cached").copy, SlotCopy::kCached);
  EXPECT_EQ(choose_slot_copy(quick, "streaming").copy, SlotCopy::kStreaming);
  EXPECT_EQ(choose_slot_copy({LinkProbe{}}, "auto").copy, SlotCopy::kCached);
  EXPECT_EQ(choose_slot_copy({}, "auto").why, "cached (no probe figures)");
}

TEST(ShmChunk, AnEighthOfTheSmallestL2AtLeast64KiBAtMostTheSlot) {
  constexpr size_t K = 1024, M = 1024 * 1024;
  EXPECT_EQ(choose_chunk(2 * M, 0, 1 * M).bytes, 256 * K);  // this guest: 2 MiB L2
  EXPECT_EQ(choose_chunk(1280 * K, 0, 1 * M).bytes, 128 * K);  // a power of two at most L2/8
  EXPECT_EQ(choose_chunk(256 * K, 0, 1 * M).bytes, 64 * K);  // never under 64 KiB
  EXPECT_EQ(choose_chunk(64 * M, 0, 1 * M).bytes, 1 * M);    // never over the slot
  EXPECT_EQ(choose_chunk(2 * M, 0, 4096).bytes, 4096u);
  const ChunkChoice unknown = choose_chunk(0, 0, 1 * M);
  EXPECT_EQ(unknown.bytes, 1 * M);
  EXPECT_NE(unknown.why.find("unknown"), std::string::npos) << unknown.why;
  const ChunkChoice set = choose_chunk(2 * M, 100000, 1 * M);  // COHORT_SHM_CHUNK_BYTES: whole lines
  EXPECT_EQ(set.bytes, 100032u);
  EXPECT_NE(set.why.find("COHORT_SHM_CHUNK_BYTES"), std::string::npos) << set.why;
  EXPECT_EQ(choose_chunk(2 * M, 8 * M, 1 * M).bytes, 1 * M);
}

TEST(ShmChunk, EveryRankOfAGroupGetsTheSameChunkAndTheCollectivesStayRight) {
  const int world = 3;
  GroupOptions o = tiny_options();
  o.slot_bytes = 1 << 20;
  o.chunk_bytes = 100 * 1024;  // not a divisor of anything below: ragged chunks everywhere
  auto groups = make_groups(world, o);
  for (int r = 0; r < world; ++r) EXPECT_EQ(groups[r]->chunk_bytes(), 100u * 1024) << r;
  test::run_ranks(world, [&](int r) {
    const size_t n = 300007;  // about 12 chunks of floats
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 11 + r);
    groups[r]->allreduce(x.data(), x.data(), n, DataType::kFloat32, ReduceOp::kSum);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(x[i], static_cast<float>(world * (i % 11) + 3)) << i;
    std::vector<uint8_t> all(3 * n), mine(n, static_cast<uint8_t>(r + 1));
    groups[r]->allgather(mine.data(), all.data(), n);
    for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], i / n + 1) << i;
  });
  // The default: the rule on this machine's L2, alike on every rank.
  auto defaults = make_groups(2, GroupOptions::from_env(2));
  EXPECT_EQ(defaults[0]->chunk_bytes(), defaults[1]->chunk_bytes());
  EXPECT_GE(defaults[0]->chunk_bytes(), std::min<size_t>(64 << 10, GroupOptions::from_env(2).slot_bytes));
}

TEST(ShmSlotCopy, AnAllreduceFarBelowTheFastestHasEveryRankProbeTheLinkAgainAtTheNextCheck) {
  for (int world : {2, 3}) {
    GroupOptions o = tiny_options();
    o.recheck_every = 4;
    auto groups = make_groups(world, o);
    const size_t n = 16 * o.slot_bytes / sizeof(float);  // 16 chunks: a "large" allreduce
    test::run_ranks(world, [&](int r) {
      std::vector<float> x(n);
      for (int op = 0; op < 8; ++op) {
        for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 7 + r + op);
        // Operation 2 waits 200 ms for rank 0: hundreds of times slower than the ones before it on
        // every rank. Its check comes with operation 3 (the 4th large allreduce).
        if (op == 2 && r == 0) std::this_thread::sleep_for(milliseconds(200));
        groups[r]->allreduce(x.data(), x.data(), n, DataType::kFloat32, ReduceOp::kSum);
        for (size_t i = 0; i < n; ++i)
          ASSERT_EQ(x[i], static_cast<float>(world * (i % 7 + op) + world * (world - 1) / 2)) << op << " " << i;
        if (op == 3) {
          ASSERT_GE(groups[r]->reprobes(), 1u) << "rank " << r;
          EXPECT_NE(groups[r]->link_line().find("probed again"), std::string::npos) << groups[r]->link_line();
        }
      }
    });
    // One decision for all: every rank probed as often as the others.
    for (int r = 1; r < world; ++r) EXPECT_EQ(groups[r]->reprobes(), groups[0]->reprobes());
  }
}

TEST(ShmGroup, InvalidArgumentsAreRejectedBeforeAnythingMoves) {
  auto groups = make_groups(2, tiny_options());
  test::run_ranks(2, [&](int r) {
    int32_t x = 1;
    EXPECT_THROW(groups[r]->allreduce(&x, &x, 1, DataType::kInt32, ReduceOp::kAvg), InvalidArgument);
    EXPECT_THROW(groups[r]->broadcast(&x, 4, 2), InvalidArgument);
    groups[r]->allreduce(&x, &x, 1, DataType::kInt32, ReduceOp::kSum);  // still usable
    EXPECT_EQ(x, 2);
  });
}

TEST(ShmGroup, MissingRankTimesOutNamingIt) {
  // Rank 1 of 2 never calls allreduce: rank 0 must give up at its deadline with a clear message.
  const std::string address = random_address("test-timeout");
  std::vector<std::unique_ptr<Group>> groups(2);
  test::run_ranks(2, [&](int r) { groups[r] = Group::create_at(address, r, 2, milliseconds(300), tiny_options()); });
  float x = 1;
  auto start = std::chrono::steady_clock::now();
  try {
    groups[0]->allreduce(&x, &x, 1, DataType::kFloat32, ReduceOp::kSum);
    FAIL() << "allreduce without the peer returned";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("local rank 1"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  // The group is failed for good now.
  EXPECT_THROW(groups[0]->allreduce(&x, &x, 1, DataType::kFloat32, ReduceOp::kSum), AbortedError);
}

// ---------------------------------------------------------------------------------------- processes

// Entries of /dev/shm that belong to cohort. The segment is a memfd and never has a name there, so this
// must stay empty; entries of other programs (Open MPI's vader segments, other tests running side by
// side) are ignored so that the check cannot flake.
std::vector<std::string> cohort_dev_shm_entries() {
  std::vector<std::string> names;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::string(e->d_name).find("cohort") != std::string::npos) names.push_back(e->d_name);
    ::closedir(d);
  }
  return names;
}

TEST(ShmGroupProcesses, AllreduceAndAllgatherAcrossRealProcesses) {
  const int world = 4;
  const std::string address = random_address("test-procs");
  auto pids = test::fork_ranks(world, [&](int r) {
    auto group = Group::create_at(address, r, world, milliseconds(20000), GroupOptions::from_env(world));
    for (size_t n : {size_t{2}, size_t{1000}, size_t{300001}}) {
      std::vector<double> buf(n, r + 1.0);
      group->allreduce(buf.data(), buf.data(), n, DataType::kFloat64, ReduceOp::kSum);
      for (double v : buf)
        if (v != world * (world + 1) / 2.0) return 1;
      std::vector<int32_t> all(n * world), mine(n, r);
      group->allgather(mine.data(), all.data(), n * sizeof(int32_t));
      for (size_t i = 0; i < all.size(); ++i)
        if (all[i] != static_cast<int32_t>(i / n)) return 2;
    }
    group->barrier();
    return 0;
  });
  const auto deadline = std::chrono::steady_clock::now() + milliseconds(60000);
  for (int r = 0; r < world; ++r) {
    int status = test::wait_for_exit(pids[r], deadline);
    ASSERT_TRUE(status != -1 && WIFEXITED(status)) << "rank " << r << " did not exit normally";
    EXPECT_EQ(0, WEXITSTATUS(status)) << "rank " << r;
  }
  EXPECT_TRUE(cohort_dev_shm_entries().empty()) << "a cohort entry appeared in /dev/shm";
}

// Waits spin without yielding only when every rank has CPUs of its own (cohort run --bind-to, mpirun's
// binding): then a yield hands the core to an unrelated process and the wait lasts its time slice
// (64 MiB allreduce 0.29 GB/s instead of 2.3 with two busy loops on a 2-core host). Ranks that share
// a CPU keep yielding, and so do ranks as threads of one process (one affinity for all).
TEST(ShmGroupProcesses, WaitsYieldOnlyWhereTheRanksCpuSetsOverlap) {
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof all, &all), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &all)) cpus.push_back(c);
  for (bool own_cpus : {true, false}) {
    if (own_cpus && cpus.size() < 2) continue;  // one CPU: no two ranks can have their own
    const std::string address = random_address("test-yield");
    auto pids = test::fork_ranks(2, [&](int r) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(own_cpus ? cpus[size_t(r)] : cpus[0], &one);
      if (sched_setaffinity(0, sizeof one, &one) != 0) return 3;
      auto group = Group::create_at(address, r, 2, milliseconds(20000), GroupOptions::from_env(2));
      if (group->waits_yield() == own_cpus) return 1;
      const std::string why = own_cpus ? "CPUs of its own" : "CPU sets overlap";
      if (group->wait_policy().find(why) == std::string::npos) return 2;
      std::vector<float> x(1000, 1.f);
      group->allreduce(x.data(), x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
      return x[999] == 2.f ? 0 : 4;
    });
    const auto deadline = std::chrono::steady_clock::now() + milliseconds(30000);
    for (int r = 0; r < 2; ++r) {
      int status = test::wait_for_exit(pids[size_t(r)], deadline);
      ASSERT_TRUE(status != -1 && WIFEXITED(status)) << "rank " << r;
      EXPECT_EQ(0, WEXITSTATUS(status)) << "rank " << r << (own_cpus ? " (a CPU each)" : " (one CPU for both)");
    }
  }
  auto groups = make_groups(2, tiny_options());  // ranks as threads: one process, one affinity
  for (auto& g : groups) EXPECT_TRUE(g->waits_yield()) << g->wait_policy();
}

TEST(ShmGroupProcesses, SigkillOfOneRankFailsTheOthersWithinTwoSecondsAndLeavesNothing) {
  const int world = 3;
  const std::string address = random_address("test-kill");
  test::TempDir dir;
  const std::string ready = dir.file("ready");
  auto pids = test::fork_ranks(world, [&](int r) {
    auto group = Group::create_at(address, r, world, milliseconds(30000), GroupOptions::from_env(world));
    std::vector<float> buf(4 << 20, 1.0f);  // 16 MiB: each allreduce takes a while
    for (int iter = 0;; ++iter) {
      if (iter == 2 && r == 0) test::write_file(ready, "1");
      try {
        group->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kMax);
      } catch (const PeerLostError& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        return 3;
      }
    }
  });
  // Wait until the ranks are busy allreducing, then kill rank 1.
  auto start = std::chrono::steady_clock::now();
  while (::access(ready.c_str(), F_OK) != 0) {
    ASSERT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "ranks never got going";
    ::usleep(5000);
  }
  ::usleep(50000);
  ASSERT_EQ(0, ::kill(pids[1], SIGKILL));
  const auto killed_at = std::chrono::steady_clock::now();
  int status = 0;
  ::waitpid(pids[1], &status, 0);
  const auto deadline = killed_at + milliseconds(10000);
  for (int r : {0, 2}) {
    int st = test::wait_for_exit(pids[r], deadline);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
    ASSERT_NE(st, -1) << "rank " << r << " still running 10 s after its peer was killed";
    ASSERT_TRUE(WIFEXITED(st)) << "rank " << r;
    EXPECT_EQ(3, WEXITSTATUS(st)) << "rank " << r << " should fail with PeerLostError";
    EXPECT_LT(seconds, 2.0) << "rank " << r << " noticed the dead peer only after " << seconds << " s";
  }
  EXPECT_TRUE(cohort_dev_shm_entries().empty()) << "a cohort entry was left behind in /dev/shm";
  // The rendezvous socket lives in the abstract namespace and is closed right after the hand-over.
  EXPECT_EQ(test::read_file("/proc/net/unix").find(address), std::string::npos) << "socket " << address << " remains";
}

}  // namespace
}  // namespace cohort::shm
