// FullyShardedDataParallel's collective schedule on a GPU (integrations/torch/fsdp.cc), expressed over
// the device communicator against the strict fake CUDA/NCCL library: the calls FSDP makes, in its
// order, with "kernels" (cudaLaunchHostFunc on the caller's stream) standing for torch's forward and
// backward kernels. This machine's libtorch has no CUDA, so FSDP itself cannot run on a GPU here
// (scripts/gpu_check.sh runs it on one); what these tests prove is that the schedule it uses is
// correct in stream order and keeps its overlap:
// - forward: a unit's all-gather is waited for in stream order (its forward kernel sees the gathered
//   values, the host does not block), and the next unit's prefetched all-gather runs beside it: the
//   kernel does not wait for the prefetch, only the next unit's does;
// - backward: a unit's reduce-scatter is called right after the backward kernel that writes its
//   flattened gradient is queued, without a host synchronisation, and reduces what that kernel wrote;
//   two reduce-scatters in flight land in stream order (FSDP's kMaxReducesInFlight);
// - mixed precision: the shards gathered in bfloat16.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/gpu.h"
#include "store/memory_store.h"
#include "fake_gpu.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kWorld = 2;
constexpr size_t kShard = 3;                 // a unit's shard: 3 elements per rank
constexpr size_t kFull = kShard * kWorld;    // the gathered unit

// A "kernel" on `stream`: runs `body` on the stream's thread, in the stream's order.
struct Kernel {
  std::function<void()> body;
  std::atomic<bool> done{false};
  void launch(void* stream) {
    static const auto launch_host_func = fake_function<int (*)(void*, void (*)(void*), void*)>("cudaLaunchHostFunc");
    ASSERT_EQ(launch_host_func(stream, [](void* k) {
      auto* self = static_cast<Kernel*>(k);
      self->body();
      self->done = true;
    }, this), 0);
  }
};

// Where a kernel reaches GPU memory (the host's own mapping of it is PROT_NONE in the fake).
float* kernel_view(const std::shared_ptr<void>& device_memory) {
  static const auto view = fake_function<void* (*)(const void*)>("fake_cuda_kernel_view");
  return static_cast<float*>(view(device_memory.get()));
}

std::vector<float> read_back(const std::shared_ptr<void>& device_memory, size_t count) {
  std::vector<float> out(count);
  gpu::copy_memory(out.data(), device_memory.get(), count * sizeof(float));  // in stream order
  return out;
}

// Rank r's shard of unit u holds u * 100 + r * kShard + i: gathered, unit u reads u * 100 + 0..5.
std::shared_ptr<void> shard_of(int unit, int rank) {
  std::vector<float> values(kShard);
  for (size_t i = 0; i < kShard; ++i) values[i] = static_cast<float>(unit * 100 + rank * static_cast<int>(kShard) + i);
  auto p = gpu::allocate_device(kShard * sizeof(float), rank);
  gpu::copy_memory(p.get(), values.data(), kShard * sizeof(float));
  return p;
}

std::vector<float> gathered_unit(int unit) {
  std::vector<float> v(kFull);
  for (size_t i = 0; i < kFull; ++i) v[i] = static_cast<float>(unit * 100 + i);
  return v;
}

// Forward of two units: unit 0 gathered and waited for, unit 1's gather started (prefetch) before unit
// 0's forward kernel is queued. Rank 1 holds back its side of the prefetch: rank 0's unit-0 kernel still
// runs (the prefetch overlaps it), and its unit-1 kernel, queued after wait(), runs only once the
// gather has.
TEST(FsdpScheduleFake, TheNextUnitsGatherOverlapsThisUnitsForwardAndItsOwnForwardWaitsForIt) {
  auto store = make_memory_store();
  std::atomic<bool> release{false};
  run_ranks(kWorld, [&](int rank) {
    auto comm = device_comm(store, rank, kWorld);
    auto shard0 = shard_of(0, rank), shard1 = shard_of(1, rank);
    auto full0 = gpu::allocate_device(kFull * sizeof(float), rank);
    auto full1 = gpu::allocate_device(kFull * sizeof(float), rank);
    void* stream = gpu::current_stream(rank);  // torch's current stream (the legacy default one)

    // run_step(unit 0): start_gather, wait_gather, then prefetch(unit 1).
    comm->allgather_async(shard0.get(), full0.get(), kShard, DataType::kFloat32)->wait();
    if (rank == 1) {
      EXPECT_TRUE(becomes_true(release, 20s));
      comm->allgather_async(shard1.get(), full1.get(), kShard, DataType::kFloat32)->wait();
      gpu::synchronize(*comm);
      EXPECT_EQ(read_back(full1, kFull), gathered_unit(1));
      return;
    }
    struct Release {
      std::atomic<bool>& flag;
      ~Release() { flag = true; }
    } release_on_exit{release};
    auto prefetch = comm->allgather_async(shard1.get(), full1.get(), kShard, DataType::kFloat32);

    std::vector<float> seen0, seen1;
    Kernel forward0{[&] { seen0.assign(kernel_view(full0), kernel_view(full0) + kFull); }};
    forward0.launch(stream);
    EXPECT_TRUE(becomes_true(forward0.done, 3s)) << "unit 0's forward waited for unit 1's prefetch (no overlap)";
    EXPECT_EQ(seen0, gathered_unit(0)) << "unit 0's forward ran before its own gather had";
    EXPECT_FALSE(prefetch->test());

    // run_step(unit 1): wait_gather orders the stream after the prefetch without blocking the host.
    const auto t0 = Clock::now();
    prefetch->wait();
    EXPECT_LT(Clock::now() - t0, 500ms) << "wait() blocked the host";
    Kernel forward1{[&] { seen1.assign(kernel_view(full1), kernel_view(full1) + kFull); }};
    forward1.launch(stream);
    EXPECT_FALSE(becomes_true(forward1.done, 300ms)) << "unit 1's forward ran before its gather";
    release = true;
    EXPECT_TRUE(becomes_true(forward1.done, 10s));
    EXPECT_EQ(seen1, gathered_unit(1));
  });
}

// Backward: each unit's backward kernel writes its flattened gradient (slowly, still running when
// FSDP calls the reduce-scatter: no host synchronisation between them), unit 1's then unit 0's, both
// reduce-scatters in flight; landing them in stream order gives each rank the sum of its slice.
TEST(FsdpScheduleFake, EachReduceScatterReducesWhatTheBackwardKernelsBeforeItWroteWithoutAHostSync) {
  auto store = make_memory_store();
  run_ranks(kWorld, [&](int rank) {
    auto comm = device_comm(store, rank, kWorld);
    void* stream = gpu::current_stream(rank);
    std::vector<std::shared_ptr<void>> flat, slice;
    std::vector<std::shared_ptr<Work>> reducing;
    std::vector<std::unique_ptr<Kernel>> backward;
    for (int unit : {1, 0}) {  // backward runs the units in reverse
      flat.push_back(gpu::allocate_device(kFull * sizeof(float), rank));
      gpu::zero_memory(flat.back().get(), kFull * sizeof(float));
      slice.push_back(gpu::allocate_device(kShard * sizeof(float), rank));
      float* grad = kernel_view(flat.back());
      backward.push_back(std::make_unique<Kernel>());
      backward.back()->body = [grad, unit, rank] {
        std::this_thread::sleep_for(250ms);  // a long backward kernel
        for (size_t i = 0; i < kFull; ++i) grad[i] = static_cast<float>((rank + 1) * (unit * 10 + static_cast<int>(i)));
      };
      backward.back()->launch(stream);
      reducing.push_back(comm->reduce_scatter_async(flat.back().get(), slice.back().get(), kShard, DataType::kFloat32,
                                                    ReduceOp::kSum));
      EXPECT_FALSE(backward.back()->done) << "the reduce-scatter call waited on the host for the backward kernel";
    }
    for (size_t k = 0; k < reducing.size(); ++k) {
      reducing[k]->wait();  // land_reduce: stream order, then the slice is read on the same stream
      const int unit = k == 0 ? 1 : 0;
      std::vector<float> expected(kShard);
      for (size_t i = 0; i < kShard; ++i)  // (1 + 2) times the gradient's pattern, at this rank's slice
        expected[i] = 3.0f * static_cast<float>(unit * 10 + rank * static_cast<int>(kShard) + static_cast<int>(i));
      EXPECT_EQ(read_back(slice[k], kShard), expected) << "unit " << unit;
    }
  });
}

// Mixed precision: the shards travel in bfloat16 (half the bytes) and gather unchanged.
TEST(FsdpScheduleFake, ShardsGatherInBfloat16) {
  auto store = make_memory_store();
  run_ranks(kWorld, [&](int rank) {
    auto comm = device_comm(store, rank, kWorld);
    // bfloat16 of 1.0 + rank and 2.0 + rank: the high halves of the floats.
    std::vector<uint16_t> shard;
    for (float f : {1.0f + rank, 2.0f + rank}) {
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);
      shard.push_back(static_cast<uint16_t>(bits >> 16));
    }
    auto d_shard = gpu::allocate_device(shard.size() * 2, rank);
    gpu::copy_memory(d_shard.get(), shard.data(), shard.size() * 2);
    auto d_full = gpu::allocate_device(shard.size() * 2 * kWorld, rank);
    comm->allgather_async(d_shard.get(), d_full.get(), shard.size(), DataType::kBFloat16)->wait();
    std::vector<uint16_t> full(shard.size() * kWorld);
    gpu::copy_memory(full.data(), d_full.get(), full.size() * 2);
    std::vector<float> values;
    for (uint16_t h : full) {
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      values.push_back(f);
    }
    EXPECT_EQ(values, (std::vector<float>{1.0f, 2.0f, 2.0f, 3.0f}));
  });
}

}  // namespace
}  // namespace cohort::test
