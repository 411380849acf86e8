// The GPU communicator on the real CUDA runtime and NCCL. Every test needs a usable GPU and is
// skipped, with the reason, without one; the last test is the opposite: on a machine without a GPU,
// asking for a GPU communicator is one clear line. scripts/gpu_check.sh runs these on a GPU machine.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/gpu.h"
#include "gpu/runtime.h"
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

// One rank per GPU (threads, as processes would be), wherever a machine has two or more: NCCL
// between GPUs in stream order, each rank writing its input on a stream of its own that the
// collective must wait for; then a rank that never calls, which the watchdog ends at the deadline by
// aborting the real NCCL communicator (whose kernels then end, so a copy ordered after them returns).
TEST(Gpu, OneRankPerGpuInStreamOrderAndTheWatchdog) {
  REQUIRE_GPU();
  if (!gpu::status().nccl) GTEST_SKIP() << "no NCCL: " << gpu::status().why_no_nccl;
  const int gpus = gpu::status().devices;
  if (gpus < 2) GTEST_SKIP() << "needs two or more GPUs (one rank per GPU); this machine has " << gpus;
  const int world = std::min(gpus, 8);
  auto store = make_memory_store();
  std::atomic<bool> rank0_done{false};
  run_ranks(world, [&](int rank) {
    CommOptions o;
    o.timeout = std::chrono::seconds(5);
    auto comm = gpu::make_device_communicator(Communicator::create(store, rank, world, o), {rank, gpu::DevicePath::kNccl});
    const size_t n = 1 << 22;  // 16 MiB
    auto d = gpu::allocate_device(n * sizeof(float), rank);
    std::vector<float> h(n, static_cast<float>(rank + 1));
    gpu::copy_memory(d.get(), h.data(), n * sizeof(float));
    comm->allreduce(d.get(), d.get(), n, DataType::kFloat32, ReduceOp::kSum);
    std::vector<float> back(n);
    gpu::copy_memory(back.data(), d.get(), n * sizeof(float));
    const float want = static_cast<float>(world * (world + 1) / 2);
    for (size_t i = 0; i < n; i += 65537) ASSERT_EQ(back[i], want) << i;
    for (int i = 0; i < 20; ++i) comm->allreduce_async(d.get(), d.get(), n, DataType::kFloat32, ReduceOp::kAvg)->wait();
    gpu::synchronize(*comm);
    comm->barrier();
    if (rank != 0) {  // the others stop calling: rank 0's next allreduce can never finish
      while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    comm->allreduce(d.get(), d.get(), n, DataType::kFloat32, ReduceOp::kSum);
    gpu::copy_memory(back.data(), d.get(), sizeof(float));  // ordered after it: returns once NCCL is aborted
    rank0_done = true;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
    EXPECT_THROW(gpu::synchronize(*comm), TimeoutError);
    EXPECT_THROW(comm->allreduce(d.get(), d.get(), n, DataType::kFloat32, ReduceOp::kSum), AbortedError);
  });
}

// The watchdog against a real NCCL communicator on a machine with one GPU, where no second rank can
// stop calling: the collective instead waits for its caller's stream, which a host function holds
// (cudaLaunchHostFunc) until the test lets it go, as a collective waits for a peer that never comes.
// The watchdog must end it at the deadline: the communicator aborted, synchronize() throwing
// TimeoutError, the next call AbortedError, and the host not blocked meanwhile.
TEST(Gpu, OneGpuWatchdogEndsACollectiveStuckBehindItsStream) {
  REQUIRE_GPU();
  if (!gpu::status().nccl) GTEST_SKIP() << "no NCCL: " << gpu::status().why_no_nccl;
  CommOptions o;
  o.timeout = std::chrono::seconds(3);
  auto comm = gpu::make_device_communicator(Communicator::create(make_memory_store(), 0, 1, o), {0, gpu::DevicePath::kNccl});
  const size_t n = 1 << 20;
  auto d = gpu::allocate_device(n * sizeof(float), 0);
  gpu::zero_memory(d.get(), n * sizeof(float));
  comm->allreduce(d.get(), d.get(), n, DataType::kFloat32, ReduceOp::kSum);  // sets the communicator up
  gpu::synchronize(*comm);

  // cudaLaunchHostFunc from the runtime cohort loaded (cohort itself never needs it).
  void* lib = dlopen(gpu::cuda_runtime().path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(lib, nullptr) << gpu::cuda_runtime().path << ": " << dlerror();
  using HostFn = void (*)(void*);
  auto launch_host_func = reinterpret_cast<int (*)(void*, HostFn, void*)>(dlsym(lib, "cudaLaunchHostFunc"));
  ASSERT_NE(launch_host_func, nullptr);
  void* stream = nullptr;
  ASSERT_EQ(gpu::cuda().StreamCreateWithFlags(&stream, gpu::kCudaStreamNonBlocking), gpu::kCudaSuccess);
  static std::atomic<bool> gate_open{false};
  gate_open = false;
  HostFn hold = [](void*) {  // bounded, so that a broken watchdog fails the test instead of hanging it
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!gate_open && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  ASSERT_EQ(launch_host_func(stream, hold, nullptr), gpu::kCudaSuccess);

  const auto t0 = std::chrono::steady_clock::now();
  {
    gpu::StreamGuard guard(0, stream);
    comm->allreduce(d.get(), d.get(), n, DataType::kFloat32, ReduceOp::kSum);  // queued behind the hold
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2)) << "the host blocked on a queued collective";
  EXPECT_THROW(gpu::synchronize(*comm), TimeoutError);
  const auto ended = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(ended, std::chrono::milliseconds(2500)) << "ended before the deadline";
  EXPECT_LT(ended, std::chrono::seconds(20)) << "the watchdog did not end it near its 3 s deadline";
  EXPECT_THROW(comm->allreduce(d.get(), d.get(), n, DataType::kFloat32, ReduceOp::kSum), AbortedError);
  gate_open = true;
  // What the GPU makes of the aborted collective's queued work once its stream runs again: recorded,
  // not asserted (NCCL promises nothing about work that had not started when the communicator was aborted).
  const int after = gpu::cuda().StreamSynchronize(stream);
  std::printf("after the hold: cudaStreamSynchronize -> %s\n", gpu::cuda_error_text(after).c_str());
  gpu::cuda().GetLastError();
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
