// The GPU communicator on the real CUDA runtime and NCCL. Every test needs a usable GPU and is
// skipped, with the reason, without one; the last test is the opposite: on a machine without a GPU,
// asking for a GPU communicator is one clear line. scripts/gpu_check.sh runs these on a GPU machine.
#include <gtest/gtest.h>

#include <cmath>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/gpu.h"
#include "store/memory_store.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

#define REQUIRE_GPU()                                                          \
  do {                                                                         \
    auto s_ = gpu::status();                                                   \
    if (!s_.usable()) GTEST_SKIP() << "no usable GPU here: " << s_.why_no_gpu; \
  } while (0)

std::shared_ptr<Communicator> host_comm(std::shared_ptr<Store> store, int rank, int world) {
  CommOptions o;
  o.timeout = std::chrono::seconds(60);
  return Communicator::create(store, rank, world, o);
}

TEST(Gpu, StatusNamesDriverRuntimeAndNccl) {
  REQUIRE_GPU();
  auto s = gpu::status();
  EXPECT_GT(s.runtime_version, 0);
  EXPECT_GT(s.driver_version, 0);
  EXPECT_GE(s.devices, 1);
  if (!s.nccl) GTEST_SKIP() << "no NCCL: " << s.why_no_nccl;
  EXPECT_GE(s.nccl_version, 21000);
}

// One rank, NCCL: every op on device memory, against the host reference.
TEST(Gpu, OneRankNcclAllreduceBroadcastAllgather) {
  REQUIRE_GPU();
  if (!gpu::status().nccl) GTEST_SKIP() << "no NCCL: " << gpu::status().why_no_nccl;
  auto comm = gpu::make_device_communicator(host_comm(make_memory_store(), 0, 1), {0, gpu::DevicePath::kNccl});
  ASSERT_EQ(gpu::device_path_of(*comm).rfind("nccl", 0), 0u) << gpu::device_path_of(*comm);
  const size_t n = 1 << 20;
  std::vector<float> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = static_cast<float>(i % 97);
  auto d = gpu::allocate_device(n * sizeof(float), 0);
  gpu::copy_memory(d.get(), h.data(), n * sizeof(float));
  comm->allreduce(d.get(), d.get(), n, DataType::kFloat32, ReduceOp::kSum);
  comm->broadcast(d.get(), n, DataType::kFloat32, 0);
  auto out = gpu::allocate_device(n * sizeof(float), 0);
  comm->allgather(d.get(), out.get(), n, DataType::kFloat32);
  comm->allreduce_async(out.get(), out.get(), n, DataType::kFloat32, ReduceOp::kAvg)->wait();
  std::vector<float> back(n);
  gpu::copy_memory(back.data(), out.get(), n * sizeof(float));
  for (size_t i = 0; i < n; i += 4099) ASSERT_EQ(back[i], h[i]) << i;
}

// Two ranks (threads) on one GPU: NCCL cannot serve them, so the staged path does, with the same sums.
TEST(Gpu, TwoRanksOnOneGpuAreStaged) {
  REQUIRE_GPU();
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    auto comm = gpu::make_device_communicator(host_comm(store, rank, 2), {0, gpu::DevicePath::kAuto});
    EXPECT_EQ(gpu::device_path_of(*comm).rfind("staged", 0), 0u) << gpu::device_path_of(*comm);
    const size_t n = 1000;
    std::vector<double> h(n, rank + 1.0);
    auto d = gpu::allocate_device(n * sizeof(double), 0);
    gpu::copy_memory(d.get(), h.data(), n * sizeof(double));
    comm->allreduce(d.get(), d.get(), n, DataType::kFloat64, ReduceOp::kSum);
    gpu::copy_memory(h.data(), d.get(), n * sizeof(double));
    EXPECT_EQ(h[0], 3.0);
    EXPECT_EQ(h[n - 1], 3.0);
  });
}

TEST(Gpu, WithoutAGpuTheRequestIsOneClearLine) {
  auto s = gpu::status();
  if (s.usable()) GTEST_SKIP() << "this machine has a GPU";
  try {
    gpu::make_device_communicator(host_comm(make_memory_store(), 0, 1));
    ADD_FAILURE() << "a GPU communicator without a GPU";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "rank 0: GPU communicator: " + s.why_no_gpu);
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
}

}  // namespace
}  // namespace cohort::test
