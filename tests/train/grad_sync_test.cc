// GradientSync (the framework-agnostic DDP engine) on ranks-as-threads over ThreadCommunicator.
#include "cohort/train/grad_sync.h"
#include "cohort/train/sgd.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <cmath>

#include "support/test_support.h"
#include "thread_communicator.h"

namespace cohort::train {
namespace {

using cohort::test::run_ranks;
using cohort::test::ThreadCommunicator;

// Four parameters of 3, 5, 7 and 2 floats (model order).
std::vector<ParameterSpec> small_model() {
  return {{"a", {3}}, {"b", {5}}, {"c", {7}}, {"d", {2}}};
}

float grad_value(int rank, size_t param, size_t i, int iteration = 0) {
  return static_cast<float>(rank + 1) * 0.5f + static_cast<float>(param) + 0.01f * static_cast<float>(i) +
         static_cast<float>(iteration) * 3.0f;
}

// Runs one iteration on `sync`: marks parameters ready in `order` with grad_value, returns the averages.
std::vector<std::vector<float>> iterate(GradientSync& sync, int rank, const std::vector<size_t>& order, int iteration = 0) {
  const auto& params = sync.parameters();
  std::vector<std::vector<float>> grads(params.size());
  for (size_t p = 0; p < params.size(); ++p)
    for (size_t i = 0; i < params[p].numel(); ++i) grads[p].push_back(grad_value(rank, p, i, iteration));
  for (size_t p : order) sync.mark_ready(p, grads[p].data());
  std::vector<std::vector<float>> out(params.size());
  sync.finish([&](size_t p, const float* avg) { out[p].assign(avg, avg + params[p].numel()); });
  return out;
}

void expect_average(const std::vector<std::vector<float>>& got, int world, int iteration, float tolerance) {
  for (size_t p = 0; p < got.size(); ++p) {
    for (size_t i = 0; i < got[p].size(); ++i) {
      float want = 0;
      for (int r = 0; r < world; ++r) want += grad_value(r, p, i, iteration);
      want /= static_cast<float>(world);
      EXPECT_NEAR(got[p][i], want, tolerance) << "param " << p << " element " << i;
    }
  }
}

GradSyncOptions tiny_buckets() {
  GradSyncOptions o;
  o.first_bucket_cap_bytes = 8 * sizeof(float);  // d + c (2 + 7 floats) close the first bucket
  o.bucket_cap_bytes = 5 * sizeof(float);
  return o;
}

// Host bucket memory that counts what the engine holds through it: what stage 2 keeps is measured
// here, outside the engine, so memory it kept beside its own counter (gradient_bytes()) shows too.
// `shared`: allocate() (the communicator's memory: buckets, parameters); `private_`: allocate_private()
// (stage 2's shard and lent buffers). Each counts the bytes asked for, live and at their peak.
class CountingMemory final : public BucketMemory {
 public:
  struct Count {
    std::atomic<size_t> live{0}, peak{0};
    void add(size_t bytes) {
      size_t now = live += bytes;
      for (size_t p = peak; now > p && !peak.compare_exchange_weak(p, now);) {}
    }
  };
  Count shared, private_;

  std::shared_ptr<void> allocate(Communicator& comm, size_t bytes) override {
    return counted(comm.allocate_shared(bytes), bytes, shared);
  }
  std::shared_ptr<void> allocate_private(size_t bytes) override {
    return counted(BucketMemory::allocate_private(bytes), bytes, private_);
  }
  void copy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  bool host_accessible() const override { return true; }

 private:
  static std::shared_ptr<void> counted(std::shared_ptr<void> memory, size_t bytes, Count& count) {
    count.add(bytes);
    void* p = memory.get();
    return std::shared_ptr<void>(p, [memory = std::move(memory), bytes, &count](void*) mutable {
      count.live -= bytes;
      memory.reset();
    });
  }
};

TEST(GradientSync, BucketsFollowReverseOrderWithSmallFirstBucket) {
  auto comms = ThreadCommunicator::make_world(1);
  GradientSync sync(comms[0], small_model(), tiny_buckets());
  // Reverse order d(2) c(7) -> 9 floats >= 8: first bucket; then b(5) >= 5; then a(3).
  EXPECT_EQ(sync.bucket_layout(), (std::vector<std::vector<size_t>>{{3, 2}, {1}, {0}}));
  // Default caps: everything in the first 1 MiB bucket.
  GradientSync defaults(comms[0], small_model());
  EXPECT_EQ(defaults.bucket_layout(), (std::vector<std::vector<size_t>>{{3, 2, 1, 0}}));
}

TEST(GradientSync, AveragesOverTwoAndThreeRanks) {
  for (int world : {2, 3}) {
    auto comms = ThreadCommunicator::make_world(world);
    run_ranks(world, [&](int rank) {
      GradientSync sync(comms[rank], small_model(), tiny_buckets());
      for (int it = 0; it < 3; ++it) expect_average(iterate(sync, rank, {3, 2, 1, 0}, it), world, it, 1e-5f);
      EXPECT_EQ(sync.stats().synced_iterations, 3);
    });
  }
}

TEST(GradientSync, BucketAllreduceStartsBeforeBackwardEnds) {
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    auto* tc = dynamic_cast<ThreadCommunicator*>(comms[rank].get());
    GradientSync sync(comms[rank], small_model(), tiny_buckets());
    const int64_t before = tc->operations();
    std::vector<float> g(7, 1.0f);
    sync.mark_ready(3, g.data());
    EXPECT_EQ(tc->operations(), before);  // first bucket still waits for c
    sync.mark_ready(2, g.data());
    EXPECT_EQ(tc->operations(), before + 1);  // first bucket launched while b and a are pending
    sync.mark_ready(1, g.data());
    EXPECT_EQ(tc->operations(), before + 2);
    sync.mark_ready(0, g.data());
    sync.finish([](size_t, const float*) {});
  });
}

TEST(GradientSync, RebuildsBucketsInReadyOrderAfterFirstIteration) {
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    GradientSync sync(comms[rank], small_model(), tiny_buckets());
    EXPECT_FALSE(sync.buckets_rebuilt());
    // Gradients arrive in the order a, c, b, d (not the registration's reverse).
    expect_average(iterate(sync, rank, {0, 2, 1, 3}), 2, 0, 1e-5f);
    EXPECT_TRUE(sync.buckets_rebuilt());
    // Decided, but built at the next iteration's first gradient (once the old buckets can go).
    EXPECT_TRUE(sync.rebuild_pending());
    // a(3) + c(7) = 10 >= 8 -> first bucket; b(5) -> second; d(2) -> third.
    EXPECT_EQ(sync.bucket_layout(), (std::vector<std::vector<size_t>>{{0, 2}, {1}, {3}}));
    expect_average(iterate(sync, rank, {0, 2, 1, 3}, 1), 2, 1, 1e-5f);
    EXPECT_FALSE(sync.rebuild_pending());
    EXPECT_EQ(sync.bucket_layout(), (std::vector<std::vector<size_t>>{{0, 2}, {1}, {3}}));
    // A rank marking in another order still works: launches wait for bucket order.
    expect_average(iterate(sync, rank, rank == 0 ? std::vector<size_t>{3, 1, 2, 0} : std::vector<size_t>{0, 1, 2, 3}, 2), 2, 2, 1e-5f);
  });
}

TEST(GradientSync, BucketsLiveInAllocateSharedMemoryBeforeAndAfterTheRebuild) {
  // On one host allocate_shared memory is what the peers map, so the buckets' allreduces run in place
  // (docs/algorithms-shm.md); ordinary heap buckets would still give right averages, hence this check.
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    auto& comm = static_cast<ThreadCommunicator&>(*comms[rank]);
    GradientSync sync(comms[rank], small_model(), tiny_buckets());
    auto all_slots_shared = [&] {
      for (size_t p = 0; p < sync.parameters().size(); ++p)
        if (!comm.from_allocate_shared(sync.gradient_slot(p).get(), sync.parameters()[p].numel() * sizeof(float)))
          return false;
      return true;
    };
    EXPECT_TRUE(all_slots_shared());
    expect_average(iterate(sync, rank, {0, 2, 1, 3}), 2, 0, 1e-5f);
    ASSERT_TRUE(sync.buckets_rebuilt());
    EXPECT_TRUE(all_slots_shared());
    expect_average(iterate(sync, rank, {0, 2, 1, 3}, 1), 2, 1, 1e-5f);  // the rebuilt buckets
    ASSERT_FALSE(sync.rebuild_pending());
    EXPECT_TRUE(all_slots_shared());
  });
}

TEST(GradientSync, CompressedWireFormats) {
  for (auto c : {WireCompression::kFloat16, WireCompression::kBFloat16}) {
    auto comms = ThreadCommunicator::make_world(3);
    run_ranks(3, [&](int rank) {
      auto o = tiny_buckets();
      o.compression = c;
      GradientSync sync(comms[rank], small_model(), o);
      // Values are below 8: float16 keeps ~3 decimal digits there, bfloat16 ~2.
      const float tol = c == WireCompression::kFloat16 ? 8.0f / 1024 : 8.0f / 128;
      expect_average(iterate(sync, rank, {3, 2, 1, 0}), 3, 0, tol);
      EXPECT_EQ(sync.stats().bytes_on_wire, 17 * 2);  // 17 parameters elements, 2 bytes each
    });
  }
}

TEST(GradientSync, NoSyncAccumulatesLocallyWithoutCommunication) {
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    auto* tc = dynamic_cast<ThreadCommunicator*>(comms[rank].get());
    GradientSync sync(comms[rank], small_model(), tiny_buckets());
    const int64_t before = tc->operations();
    {
      NoSyncGuard guard(sync);
      std::vector<float> g(7, 1.0f);
      for (size_t p = 0; p < 4; ++p) sync.mark_ready(p, g.data());
      EXPECT_FALSE(sync.finish([](size_t, const float*) { ADD_FAILURE() << "no write-back under no_sync"; }));
    }
    EXPECT_EQ(tc->operations(), before);
    EXPECT_TRUE(sync.sync_enabled());
    expect_average(iterate(sync, rank, {3, 2, 1, 0}), 2, 0, 1e-5f);
  });
}

TEST(GradientSync, ParameterWithoutGradientIsAnErrorNamingIt) {
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    GradientSync sync(comms[rank], small_model(), tiny_buckets());
    std::vector<float> g(7, 1.0f);
    for (size_t p : {3, 2, 0}) sync.mark_ready(p, g.data());
    try {
      sync.finish([](size_t, const float*) {});
      ADD_FAILURE() << "expected an error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("parameter b [5]"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("find_unused_parameters"), std::string::npos) << e.what();
    }
  });
}

TEST(GradientSync, FindUnusedParametersContributesZeros) {
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    auto o = tiny_buckets();
    o.find_unused_parameters = true;
    GradientSync sync(comms[rank], small_model(), o);
    std::vector<float> g(7, static_cast<float>(rank + 1));
    // b is unused on rank 1 only: its average is rank 0's gradient / 2.
    for (size_t p : {3, 2, 1, 0})
      if (!(p == 1 && rank == 1)) sync.mark_ready(p, g.data());
    std::vector<float> b;
    sync.finish([&](size_t p, const float* avg) {
      if (p == 1) b.assign(avg, avg + 5);
    });
    for (float v : b) EXPECT_FLOAT_EQ(v, 0.5f);
  });
}

TEST(GradientSync, MismatchedParametersNameTheFirstDifference) {
  auto comms = ThreadCommunicator::make_world(3);
  run_ranks(3, [&](int rank) {
    auto params = small_model();
    if (rank == 2) params[2].shape = {7, 1};
    try {
      GradientSync sync(comms[rank], params);
      ADD_FAILURE() << "expected MismatchError on rank " << rank;
    } catch (const MismatchError& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("parameter #2 is c [7] on rank 0"), std::string::npos) << m;
      EXPECT_NE(m.find("rank 2"), std::string::npos) << m;
      if (rank == 2) {
        EXPECT_NE(m.find("c [7, 1]"), std::string::npos) << m;
      }
    }
  });
}

// Fused update: parameters in their slots, initial value param_value; returns them after
// finish_update with SGD lr 0.5 (moving them to the new slots after the bucket rebuild, as the
// framework does).
float param_value(size_t param, size_t i) { return static_cast<float>(param) - 0.25f * static_cast<float>(i); }

TEST(GradientSync, FusedUpdateAppliesSgdToTheAveragedGradientsInEveryRanksParameterSlots) {
  for (int world : {2, 3}) {
    auto comms = ThreadCommunicator::make_world(world);
    run_ranks(world, [&](int rank) {
      GradientSync sync(comms[rank], small_model(), tiny_buckets());
      sync.enable_fused_update();
      ASSERT_TRUE(sync.fused_update());
      const auto& params = sync.parameters();
      std::vector<std::shared_ptr<float>> slots;
      for (size_t p = 0; p < params.size(); ++p) {
        slots.push_back(sync.parameter_slot(p));
        for (size_t i = 0; i < params[p].numel(); ++i) slots[p].get()[i] = param_value(p, i);
      }
      std::vector<float> expected_sum(64, 0.0f);  // per (param, element): the lr-scaled averages so far
      for (int iteration = 0; iteration < 3; ++iteration) {
        std::vector<std::vector<float>> grads(params.size());
        for (size_t p = 0; p < params.size(); ++p)
          for (size_t i = 0; i < params[p].numel(); ++i) grads[p].push_back(grad_value(rank, p, i, iteration));
        for (size_t p : {3, 2, 1, 0}) sync.mark_ready(p, grads[p].data());
        ASSERT_TRUE(sync.finish_update([](size_t, size_t n, const float* avg, float* w) {
          sgd_step(w, avg, n, {0.5f, 0.0f});
        }));
        for (size_t p = 0; p < params.size(); ++p) {
          // After the first iteration the buckets are rebuilt: the values move to the new slots.
          std::shared_ptr<float> now = sync.parameter_slot(p);
          if (now.get() != slots[p].get()) std::memcpy(now.get(), slots[p].get(), params[p].numel() * sizeof(float));
          slots[p] = now;
          for (size_t i = 0; i < params[p].numel(); ++i) {
            float avg = 0;
            for (int r = 0; r < world; ++r) avg += grad_value(r, p, i, iteration);
            expected_sum[p * 16 + i] += 0.5f * avg / static_cast<float>(world);
            EXPECT_NEAR(slots[p].get()[i], param_value(p, i) - expected_sum[p * 16 + i], 1e-4f)
                << "world " << world << " iteration " << iteration << " param " << p << " element " << i;
          }
        }
        EXPECT_EQ(sync.buckets_rebuilt(), true);
      }
      EXPECT_EQ(sync.stats().synced_iterations, 3);
      // Several buckets, but one allreduce_update per step: the buckets lie back to back in one
      // gradient and one parameter buffer.
      EXPECT_GT(sync.bucket_layout().size(), 1u);
      EXPECT_EQ(sync.stats().allreduces, 3) << "world " << world;
    });
  }
}

TEST(GradientSync, FusedUpdateStillAveragesOnRequestAndIsRefusedWhereItCannotRun) {
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    GradientSync sync(comms[rank], small_model(), tiny_buckets());
    sync.enable_fused_update();
    // finish() averages (to clip before the step, say); finish_update then has nothing to reduce.
    expect_average(iterate(sync, rank, {3, 2, 1, 0}), 2, 0, 1e-5f);
    EXPECT_FALSE(sync.finish_update([](size_t, size_t, const float*, float*) { ADD_FAILURE() << "no update"; }));
    // A parameter without gradient is named, as by finish().
    std::vector<float> g(7, 1.0f);
    for (size_t p : {3, 2, 0}) sync.mark_ready(p, g.data());
    try {
      sync.finish_update([](size_t, size_t, const float*, float*) {});
      ADD_FAILURE() << "expected an error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("parameter b [5]"), std::string::npos) << e.what();
    }
    auto o = tiny_buckets();
    o.compression = WireCompression::kBFloat16;
    GradientSync compressed(comms[rank], small_model(), o);
    EXPECT_THROW(compressed.enable_fused_update(), InvalidArgument);
  });
  // One rank: the framework's own optimizer steps.
  auto one = ThreadCommunicator::make_world(1);
  GradientSync solo(one[0], small_model());
  solo.enable_fused_update();
  EXPECT_FALSE(solo.fused_update());
  EXPECT_EQ(solo.parameter_slot(0), nullptr);
}

TEST(GradientSync, SgdStepIsTorchsFormula) {
  std::vector<float> p = {1.0f, -2.0f, 0.5f}, g = {0.5f, 0.25f, -1.0f};
  sgd_step(p.data(), g.data(), p.size(), {0.1f, 0.0f});
  EXPECT_FLOAT_EQ(p[0], 1.0f - 0.1f * 0.5f);
  EXPECT_FLOAT_EQ(p[2], 0.5f + 0.1f);
  std::vector<float> q = {1.0f, -2.0f, 0.5f};
  sgd_step(q.data(), g.data(), q.size(), {0.1f, 0.01f});  // weight decay joins the gradient first
  EXPECT_FLOAT_EQ(q[1], -2.0f - 0.1f * (0.25f + 0.01f * -2.0f));
  // Long enough for the vector loop and its tail.
  std::vector<float> big(1000, 2.0f), ones(1000, 1.0f);
  sgd_step(big.data(), ones.data(), big.size(), {0.5f, 0.0f});
  for (float v : big) ASSERT_EQ(v, 1.5f);
}

TEST(GradientSync, WireCompressionThatDiffersBetweenRanksIsAMismatchNamingBoth) {
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    auto o = tiny_buckets();
    if (rank == 1) o.compression = WireCompression::kBFloat16;
    try {
      GradientSync sync(comms[rank], small_model(), o);
      ADD_FAILURE() << "expected MismatchError on rank " << rank;
    } catch (const MismatchError& e) {
      EXPECT_NE(std::string(e.what()).find("none on rank 0 but bf16 on rank 1"), std::string::npos) << e.what();
    }
  });
}

TEST(GradientSync, GradientTwiceInOneIterationIsAnError) {
  auto comms = ThreadCommunicator::make_world(1);
  GradientSync sync(comms[0], small_model());
  std::vector<float> g(7, 1.0f);
  sync.mark_ready(1, g.data());
  EXPECT_THROW(sync.mark_ready(1, g.data()), InvalidArgument);
}


// Sharded mode: every rank ends with the average of its chunk of every bucket, the padding reads as
// zeros, and gather_parameters() brings every rank's chunk of the parameters to all.
void check_sharded_chunks(int world, int stage, WireCompression compression, float tolerance) {
  auto comms = ThreadCommunicator::make_world(world);
  run_ranks(world, [&](int rank) {
    GradSyncOptions o = tiny_buckets();
    o.compression = compression;
    GradientSync sync(comms[size_t(rank)], small_model(), o);
    sync.enable_sharding(stage);
    ASSERT_EQ(sync.sharding_stage(), stage);
    const auto layout = sync.bucket_layout();
    const auto& params = sync.parameters();
    for (int iteration = 0; iteration < 3; ++iteration) {
      std::vector<std::vector<float>> grads(params.size());
      for (size_t p = 0; p < params.size(); ++p)
        for (size_t i = 0; i < params[p].numel(); ++i) grads[p].push_back(grad_value(rank, p, i, iteration));
      for (size_t p = params.size(); p-- > 0;) sync.mark_ready(p, grads[p].data());
      ASSERT_TRUE(sync.finish_sharded());
      for (const auto& chunk : sync.shard_chunks()) {
        ASSERT_EQ(chunk.count * size_t(world), sync.padded_numel(chunk.bucket));
        ASSERT_EQ(chunk.bucket_offset, size_t(rank) * chunk.count);
        size_t at = 0;  // the bucket's parameters back to back, then padding
        std::vector<float> want(sync.padded_numel(chunk.bucket), 0.0f);
        for (size_t p : layout[chunk.bucket])
          for (size_t i = 0; i < params[p].numel(); ++i, ++at) {
            for (int r = 0; r < world; ++r) want[at] += grad_value(r, p, i, iteration);
            want[at] /= float(world);
          }
        for (size_t i = 0; i < chunk.count; ++i)
          EXPECT_NEAR(chunk.gradients[i], want[chunk.bucket_offset + i], tolerance)
              << "stage " << stage << ", rank " << rank << ", bucket " << chunk.bucket << ", element " << i;
      }
    }
    // Each rank writes its rank into its chunks; after the gather every rank sees every owner's value.
    for (const auto& chunk : sync.shard_chunks())
      for (size_t i = 0; i < chunk.count; ++i) chunk.parameters[i] = float(rank * 1000) + float(i);
    sync.gather_parameters();
    for (size_t p = 0; p < params.size(); ++p) {
      float* slot = sync.parameter_slot(p).get();
      ASSERT_NE(slot, nullptr);
      const size_t b = [&] {
        for (size_t i = 0; i < layout.size(); ++i)
          if (std::find(layout[i].begin(), layout[i].end(), p) != layout[i].end()) return i;
        return layout.size();
      }();
      size_t offset = 0;
      for (size_t q : layout[b]) {
        if (q == p) break;
        offset += params[q].numel();
      }
      const size_t chunk = sync.padded_numel(b) / size_t(world);
      for (size_t i = 0; i < params[p].numel(); ++i) {
        const size_t owner = (offset + i) / chunk;
        EXPECT_EQ(slot[i], float(owner * 1000) + float((offset + i) % chunk)) << "parameter " << p << " element " << i;
      }
    }
  });
}

TEST(GradientSync, ShardedStagesOneAndTwoAverageEachRanksChunkAndGatherTheParameters) {
  for (int world : {1, 2, 3})
    for (int stage : {1, 2}) check_sharded_chunks(world, stage, WireCompression::kNone, 1e-5f);
  check_sharded_chunks(3, 2, WireCompression::kBFloat16, 0.1f);
  check_sharded_chunks(2, 1, WireCompression::kFloat16, 0.02f);
}

TEST(GradientSync, ShardedStageTwoLendsBucketMemoryAndKeepsOnlyItsChunks) {
  // 40 parameters of 10 floats in buckets of 10: at most three buckets' memory at once (two
  // reduce-scatters in flight and one filling), not forty.
  std::vector<ParameterSpec> model;
  for (int i = 0; i < 40; ++i) model.push_back({"p" + std::to_string(i), {10}});
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    auto memory = std::make_shared<CountingMemory>();
    GradSyncOptions o;
    o.first_bucket_cap_bytes = o.bucket_cap_bytes = 10 * sizeof(float);
    o.memory = memory;
    GradientSync sync(comms[size_t(rank)], model, o);
    const size_t whole = sync.gradient_bytes();
    EXPECT_EQ(whole, 400 * sizeof(float));
    EXPECT_EQ(memory->shared.live, whole);
    sync.enable_sharding(2);
    EXPECT_EQ(sync.gradient_slot(0), nullptr);  // nothing for a framework's gradient to stay a view of
    std::vector<float> grad(10, 1.0f + float(rank));
    for (int iteration = 0; iteration < 2; ++iteration) {
      for (size_t p = 40; p-- > 0;) sync.mark_ready(p, grad.data());
      ASSERT_TRUE(sync.finish_sharded());
    }
    // Counted through the memory: the communicator's memory holds the parameters (400 floats) and no
    // gradient bucket; the rank's own holds the chunks (200 floats) and, at any time, at most three
    // 10-float buffers. The engine's counter says what is held now.
    EXPECT_EQ(memory->shared.live, 400 * sizeof(float));
    EXPECT_LE(memory->private_.peak, (200 + 3 * 10) * sizeof(float));
    EXPECT_EQ(sync.gradient_bytes(), memory->private_.live);
    for (const auto& chunk : sync.shard_chunks())
      for (size_t i = 0; i < chunk.count; ++i) ASSERT_FLOAT_EQ(chunk.gradients[i], 1.5f);
  });
}

TEST(GradientSync, ShardedStageTwoLendsALargeParametersBucketItsOwnSizeOfMemory) {
  // 30 parameters of 10 floats in buckets of 10, and one of 400 (a word embedding beside the layers):
  // the regular buckets share 10-float buffers; only the 400-float bucket takes a 400-float one. With
  // one size for all, every buffer was 400 floats: three of them.
  std::vector<ParameterSpec> model;
  for (int i = 0; i < 15; ++i) model.push_back({"a" + std::to_string(i), {10}});
  model.push_back({"embedding", {40, 10}});
  for (int i = 0; i < 15; ++i) model.push_back({"b" + std::to_string(i), {10}});
  for (WireCompression wire : {WireCompression::kNone, WireCompression::kBFloat16}) {
    auto comms = ThreadCommunicator::make_world(2);
    run_ranks(2, [&](int rank) {
      auto memory = std::make_shared<CountingMemory>();
      GradSyncOptions o;
      o.first_bucket_cap_bytes = o.bucket_cap_bytes = 10 * sizeof(float);
      o.compression = wire;
      o.memory = memory;
      GradientSync sync(comms[size_t(rank)], model, o);
      sync.enable_sharding(2);
      for (int iteration = 0; iteration < 3; ++iteration) {
        for (size_t p = model.size(); p-- > 0;) {
          std::vector<float> grad(p == 15 ? 400 : 10, float(p % 7) + float(rank));
          sync.mark_ready(p, grad.data());
        }
        ASSERT_TRUE(sync.finish_sharded());
        // Every rank's chunk holds the average of both ranks' gradients: p % 7 + 0.5.
        for (const auto& chunk : sync.shard_chunks()) {
          const std::vector<size_t> layout = sync.bucket_layout()[chunk.bucket];
          ASSERT_EQ(layout.size(), 1u);
          for (size_t i = 0; i < chunk.count; ++i)
            ASSERT_NEAR(chunk.gradients[i], float(layout[0] % 7) + 0.5f, 0.05f) << "parameter " << layout[0];
        }
      }
      // Counted through the memory: the chunks (700 floats over 2 ranks: 350), at most three 10-float
      // buffers and one of 400 (each with its wire copy when compressed), never more at once.
      const size_t per_float = sizeof(float) + (wire == WireCompression::kNone ? 0 : sizeof(uint16_t));
      EXPECT_LE(memory->private_.peak, 350 * sizeof(float) + (3 * 10 + 400) * per_float);
      EXPECT_EQ(sync.gradient_bytes(), memory->private_.live);
    });
  }
}

TEST(GradientSync, ShardedStageTwoKeepsOneBufferSizeWhenMostBucketsAreLarge) {
  // 8 parameters of 400 floats (big matrices) and 4 of 10, in buckets of 10 floats: two sizes would hold
  // three 400-float buffers and three 10-float ones; one size holds only the three 400-float ones. The
  // large buckets come one after another, so two are in flight while a third waits: all averages right.
  std::vector<ParameterSpec> model;
  for (int i = 0; i < 12; ++i) model.push_back({"p" + std::to_string(i), {i % 3 == 0 ? 10 : 400}});
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    auto memory = std::make_shared<CountingMemory>();
    GradSyncOptions o;
    o.first_bucket_cap_bytes = o.bucket_cap_bytes = 10 * sizeof(float);
    o.memory = memory;
    GradientSync sync(comms[size_t(rank)], model, o);
    sync.enable_sharding(2);
    for (int iteration = 0; iteration < 3; ++iteration) {
      for (size_t p = model.size(); p-- > 0;) {
        std::vector<float> grad(size_t(model[p].shape[0]), float(p % 7) + float(rank));
        sync.mark_ready(p, grad.data());
      }
      ASSERT_TRUE(sync.finish_sharded());
      for (const auto& chunk : sync.shard_chunks()) {
        const std::vector<size_t> layout = sync.bucket_layout()[chunk.bucket];
        for (size_t i = 0; i < chunk.count; ++i)
          ASSERT_FLOAT_EQ(chunk.gradients[i], float(layout[0] % 7) + 0.5f) << "parameter " << layout[0];
      }
    }
    // The chunks (3240 floats over 2 ranks: 1620) and at most three buffers, all of 400 floats: with
    // two sizes some would be 10-float ones.
    // Counted through the memory, as the test above.
    const size_t lent = memory->private_.live - 1620 * sizeof(float);
    EXPECT_EQ(lent % (400 * sizeof(float)), 0u) << lent << " bytes lent";
    EXPECT_LE(memory->private_.peak, (1620 + 3 * 400) * sizeof(float));
    EXPECT_EQ(sync.gradient_bytes(), memory->private_.live);
  });
}

TEST(GradientSync, ShardedStageThatDiffersBetweenRanksIsAMismatchNamingBoth) {
  auto comms = ThreadCommunicator::make_world(2);
  run_ranks(2, [&](int rank) {
    GradientSync sync(comms[size_t(rank)], small_model(), tiny_buckets());
    try {
      sync.enable_sharding(rank + 1);
      FAIL() << "no error";
    } catch (const MismatchError& e) {
      EXPECT_NE(std::string(e.what()).find("stage differs between ranks: 1 on rank 0 but 2 on rank 1"), std::string::npos)
          << e.what();
    }
  });
  auto one = ThreadCommunicator::make_world(1);
  GradientSync sync(one[0], small_model(), tiny_buckets());
  EXPECT_THROW(sync.enable_sharding(3), InvalidArgument);
  sync.enable_sharding(1);
  EXPECT_THROW(sync.finish([](size_t, const float*) {}), InvalidArgument);
}

}  // namespace
}  // namespace cohort::train
