// The data-parallel engine with its buckets in GPU memory (train::gpu_bucket_memory) over the GPU
// communicator, against the fake CUDA/NCCL library: averages are right, gradients that are views of
// their bucket slots are not copied, and compression is refused for GPU buckets.
#include <gtest/gtest.h>

#include "cohort/error.h"
#include "cohort/gpu.h"
#include "store/memory_store.h"
#include "support/test_support.h"
#include "cohort/train/grad_sync.h"

namespace cohort::test {
namespace {

TEST(GpuGradSyncFake, GpuBucketsAverageAcrossRanks) {
  const int world = 3;
  auto store = make_memory_store();
  run_ranks(world, [&](int rank) {
    CommOptions o;
    o.timeout = std::chrono::seconds(30);
    auto comm = gpu::make_device_communicator(Communicator::create(store, rank, world, o), {rank, gpu::DevicePath::kAuto});
    std::vector<train::ParameterSpec> params = {{"w1", {5}}, {"w2", {3}}, {"b", {2}}};
    train::GradSyncOptions so;
    so.memory = train::gpu_bucket_memory(rank);
    so.first_bucket_cap_bytes = 8;  // several buckets
    so.bucket_cap_bytes = 16;
    train::GradientSync sync(comm, params, so);
    std::vector<std::shared_ptr<void>> grads;
    for (const auto& p : params) {
      std::vector<float> g(p.numel(), static_cast<float>(rank + 1));
      grads.push_back(gpu::allocate_device(g.size() * sizeof(float), rank));
      gpu::copy_memory(grads.back().get(), g.data(), g.size() * sizeof(float));
    }
    for (int iteration = 0; iteration < 2; ++iteration) {
      for (size_t i = params.size(); i-- > 0;) {
        // Second iteration: the gradient lives in its bucket slot (gradient_as_bucket_view).
        const float* g = static_cast<const float*>(grads[i].get());
        // Held until mark_ready has read it: the first mark_ready of this iteration builds the rebuilt
        // buckets, and only this handle keeps the old slot alive until its gradient is copied over.
        std::shared_ptr<float> slot;
        if (iteration == 1) {
          slot = sync.gradient_slot(i);
          ASSERT_TRUE(gpu::is_device_pointer(slot.get()));
          std::vector<float> v(params[i].numel(), static_cast<float>(rank + 1));
          gpu::copy_memory(slot.get(), v.data(), v.size() * sizeof(float));
          g = slot.get();
        }
        sync.mark_ready(i, g);
      }
      ASSERT_TRUE(sync.all_ready());
      std::vector<std::vector<float>> averaged(params.size());
      sync.finish([&](size_t i, const float* avg) {
        EXPECT_TRUE(gpu::is_device_pointer(avg));
        averaged[i].resize(params[i].numel());
        gpu::copy_memory(averaged[i].data(), avg, averaged[i].size() * sizeof(float));
      });
      for (size_t i = 0; i < averaged.size(); ++i)
        for (float v : averaged[i])
          EXPECT_FLOAT_EQ(v, 2.0f) << "iteration " << iteration << " parameter " << i;  // mean of 1, 2, 3
    }
    EXPECT_TRUE(sync.buckets_rebuilt());
    EXPECT_EQ(sync.stats().synced_iterations, 2);

    train::GradSyncOptions fp16 = so;
    fp16.compression = train::WireCompression::kFloat16;
    try {
      train::GradientSync bad(comm, params, fp16);
      ADD_FAILURE() << "compression accepted for GPU buckets";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("GPU buckets travel as float32 through NCCL"), std::string::npos);
    }
  });
}

}  // namespace
}  // namespace cohort::test
