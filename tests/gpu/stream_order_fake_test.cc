// Stream order and the failure path of the GPU communicator, against the strict fake CUDA/NCCL
// library (tests/gpu/fake_cuda.cc: streams that really order, a legacy default stream that
// synchronises with blocking streams, cudaStreamWaitEvent that waits, freed communicators that abort
// the process when used). What ProcessGroupNCCL users rely on, and what a host-synchronous wrapper
// gets wrong:
// - compute queued after a collective does not wait for it (overlap), until the caller waits;
// - a collective sees what the caller's stream wrote before it was called;
// - Work::wait() does not block the host, test() and synchronize() are bounded and see a peer's
//   failure, and the watchdog ends an operation nobody waits for;
// - nothing reaches NCCL after ncclCommAbort.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/gpu.h"
#include "cohort/train/grad_sync.h"
#include "store/memory_store.h"
#include "fake_gpu.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

using gpu::DeviceOptions;
using gpu::DevicePath;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// The fake's own entry points with CUDA's signatures: "kernels" (cudaLaunchHostFunc) and streams.
struct FakeCuda {
  int (*launch_host_func)(void* stream, void (*fn)(void*), void* data);
  int (*stream_create)(void** stream, unsigned flags);
  int (*stream_destroy)(void* stream);
  void* (*kernel_view)(const void* device_pointer);  // where a "kernel" reaches GPU memory
  void (*exit_rank)(int device);                       // that rank's process exits
  FakeCuda() {
    void* h = dlopen(COHORT_FAKE_CUDA, RTLD_NOW);
    EXPECT_NE(h, nullptr) << dlerror();
    launch_host_func = reinterpret_cast<decltype(launch_host_func)>(dlsym(h, "cudaLaunchHostFunc"));
    stream_create = reinterpret_cast<decltype(stream_create)>(dlsym(h, "cudaStreamCreateWithFlags"));
    stream_destroy = reinterpret_cast<decltype(stream_destroy)>(dlsym(h, "cudaStreamDestroy"));
    kernel_view = reinterpret_cast<decltype(kernel_view)>(dlsym(h, "fake_cuda_kernel_view"));
    exit_rank = reinterpret_cast<decltype(exit_rank)>(dlsym(h, "fake_nccl_exit"));
  }
  // Queues a kernel on `stream` that sets `flag` (after `delay`, to model a long kernel).
  void set_flag(void* stream, std::atomic<bool>* flag) {
    launch_host_func(stream, [](void* f) { static_cast<std::atomic<bool>*>(f)->store(true); }, flag);
  }
};
FakeCuda& fake() {
  static FakeCuda f;
  return f;
}

std::shared_ptr<void> device_floats(const std::vector<float>& values, int device) {
  auto p = gpu::allocate_device(values.size() * sizeof(float), device);
  gpu::copy_memory(p.get(), values.data(), values.size() * sizeof(float));
  return p;
}

// The overlap DDP needs: a bucket's allreduce is queued, rank 1 is late, and the "backward kernel"
// queued next on the compute stream (the legacy default stream, where torch computes by default)
// still runs at once. Only wait() orders the compute stream after the allreduce, without blocking
// the host.
TEST(GpuStreams, ComputeQueuedAfterACollectiveDoesNotWaitForIt) {
  auto store = make_memory_store();
  std::atomic<bool> release{false};
  run_ranks(2, [&](int rank) {
    auto comm = device_comm(store, rank, 2);
    auto buf = device_floats({1.0f + rank, 2.0f, 3.0f}, rank);
    comm->barrier();
    if (rank == 1) {
      EXPECT_TRUE(becomes_true(release, 20s));
      comm->allreduce(buf.get(), buf.get(), 3, DataType::kFloat32, ReduceOp::kSum);
      gpu::synchronize(*comm);
      return;
    }
    struct Release {
      std::atomic<bool>& flag;
      ~Release() { flag = true; }
    } release_on_exit{release};
    auto work = comm->allreduce_async(buf.get(), buf.get(), 3, DataType::kFloat32, ReduceOp::kSum);
    std::atomic<bool> backward_ran{false};
    fake().set_flag(gpu::current_stream(0), &backward_ran);
    EXPECT_TRUE(becomes_true(backward_ran, 3s)) << "compute queued after the allreduce waited for it (no overlap)";
    EXPECT_FALSE(work->test());

    const auto t0 = Clock::now();
    work->wait();  // stream order: the compute stream now waits for the allreduce
    EXPECT_LT(Clock::now() - t0, 500ms) << "wait() blocked the host";
    std::atomic<bool> optimizer_ran{false};
    fake().set_flag(gpu::current_stream(0), &optimizer_ran);
    EXPECT_FALSE(becomes_true(optimizer_ran, 300ms)) << "the optimizer ran before the allreduce it waited for";
    release = true;
    EXPECT_TRUE(becomes_true(optimizer_ran, 10s));
    std::vector<float> out(3);
    gpu::copy_memory(out.data(), buf.get(), sizeof(float) * 3);
    EXPECT_EQ(out, (std::vector<float>{3.0f, 4.0f, 6.0f}));
  });
}

// Inputs written by a kernel on the caller's own (non-blocking) stream, still running when the
// collective is called: the collective waits for it, and the caller's read-back (same stream) waits
// for the collective.
TEST(GpuStreams, ACollectiveSeesWhatTheCallersStreamWroteBeforeIt) {
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    auto comm = device_comm(store, rank, 2);
    auto buf = device_floats({0.0f, 0.0f}, rank);
    void* stream = nullptr;
    ASSERT_EQ(fake().stream_create(&stream, 1), 0);
    {
      gpu::StreamGuard on(rank, stream);
      EXPECT_EQ(gpu::current_stream(rank), stream);
      struct Write {
        float* dst;
        float value;
      } write{static_cast<float*>(fake().kernel_view(buf.get())), 10.0f * (rank + 1)};
      fake().launch_host_func(stream, [](void* p) {
        auto* w = static_cast<Write*>(p);
        std::this_thread::sleep_for(100ms);  // a long kernel
        w->dst[0] = w->value;
        w->dst[1] = w->value + 1;
      }, &write);
      comm->allreduce(buf.get(), buf.get(), 2, DataType::kFloat32, ReduceOp::kSum);
      std::vector<float> out(2);
      gpu::copy_memory(out.data(), buf.get(), sizeof(float) * 2);
      EXPECT_EQ(out, (std::vector<float>{30.0f, 32.0f}));
    }
    EXPECT_EQ(gpu::current_stream(rank), nullptr);
    gpu::synchronize(*comm);
    fake().stream_destroy(stream);
  });
}

// A peer that never calls (stopped, hung): polling test() ends at the operation's deadline with a
// TimeoutError naming rank, GPU and operation, instead of looping forever.
TEST(GpuStreams, TestIsBoundedByTheDeadlineWhenAPeerNeverCalls) {
  auto store = make_memory_store();
  std::atomic<bool> rank0_done{false};
  run_ranks(2, [&](int rank) {
    auto comm = device_comm(store, rank, 2, 800ms);
    auto buf = gpu::allocate_device(4 * sizeof(float), rank);
    comm->barrier();
    if (rank == 1) {
      EXPECT_TRUE(becomes_true(rank0_done, 20s));
      return;
    }
    auto work = comm->allreduce_async(buf.get(), buf.get(), 4, DataType::kFloat32, ReduceOp::kSum);
    const auto t0 = Clock::now();
    while (!work->test() && Clock::now() - t0 < 10s) std::this_thread::sleep_for(5ms);
    rank0_done = true;
    EXPECT_LT(Clock::now() - t0, 5s) << "test() never gave up";
    ASSERT_TRUE(work->test());
    std::exception_ptr e = work->exception();
    ASSERT_NE(e, nullptr);
    try {
      std::rethrow_exception(e);
    } catch (const TimeoutError& t) {
      EXPECT_NE(std::string(t.what()).find("rank 0 (GPU 0): allreduce of 16 bytes did not finish on the GPU within 800 ms"),
                std::string::npos)
          << t.what();
    }
  });
}

// A peer whose process exits: NCCL's socket transport sees its connections close and reports an
// asynchronous error, which test() reports as a lost peer long before the deadline (checking only
// the CUDA event reported success). NCCL promises nothing like it for a peer that is alive but
// stopped or aborted its communicator: that one is the deadline's (the tests above).
TEST(GpuStreams, TestSeesAPeersFailure) {
  auto store = make_memory_store();
  std::atomic<bool> queued{false};
  run_ranks(2, [&](int rank) {
    auto comm = device_comm(store, rank, 2, 30s);
    auto buf = gpu::allocate_device(4 * sizeof(float), rank);
    comm->barrier();
    if (rank == 1) {
      EXPECT_TRUE(becomes_true(queued, 20s));
      fake().exit_rank(1);
      return;
    }
    auto work = comm->allreduce_async(buf.get(), buf.get(), 4, DataType::kFloat32, ReduceOp::kSum);
    queued = true;
    const auto t0 = Clock::now();
    while (!work->test() && Clock::now() - t0 < 10s) std::this_thread::sleep_for(5ms);
    EXPECT_LT(Clock::now() - t0, 5s);
    std::exception_ptr e = work->exception();
    ASSERT_NE(e, nullptr) << "test() said the allreduce succeeded, though the peer never took part";
    try {
      std::rethrow_exception(e);
    } catch (const PeerLostError& p) {
      EXPECT_NE(std::string(p.what()).find("rank 0 (GPU 0): NCCL reports an error during allreduce"), std::string::npos)
          << p.what();
    }
  });
}

// Nobody waits: a blocking call returns (stream order) and the program does host work. The watchdog
// aborts the stuck operation at its deadline; the next call names the cause.
TEST(GpuStreams, TheWatchdogEndsAnOperationNobodyWaitsFor) {
  auto store = make_memory_store();
  std::atomic<bool> rank0_done{false};
  run_ranks(2, [&](int rank) {
    auto comm = device_comm(store, rank, 2, 600ms);
    auto buf = gpu::allocate_device(4 * sizeof(float), rank);
    comm->barrier();
    if (rank == 1) {
      EXPECT_TRUE(becomes_true(rank0_done, 20s));
      return;
    }
    comm->allreduce(buf.get(), buf.get(), 4, DataType::kFloat32, ReduceOp::kSum);
    std::this_thread::sleep_for(1500ms);  // host work; no wait, no test(), no synchronize
    rank0_done = true;
    try {
      comm->broadcast(buf.get(), 4, DataType::kFloat32, 0);
      ADD_FAILURE() << "the watchdog did not end the stuck allreduce";
    } catch (const AbortedError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 (GPU 0): allreduce of 16 bytes did not finish on the GPU within "
                                           "600 ms"),
                std::string::npos)
          << e.what();
    }
  });
}

// After abort(): no NCCL call at all (the strict fake aborts the process on a freed communicator):
// every operation, barrier, wait and synchronize throws AbortedError naming the reason.
TEST(GpuStreams, NothingReachesNcclAfterAbort) {
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    auto comm = device_comm(store, rank, 2);
    auto buf = device_floats({1.0f, 2.0f}, rank);
    auto before = comm->allreduce_async(buf.get(), buf.get(), 2, DataType::kFloat32, ReduceOp::kSum);
    before->synchronize();
    comm->abort("aborted on purpose (test)");
    auto expect_aborted = [&](const char* what, const std::function<void()>& f) {
      try {
        f();
        ADD_FAILURE() << what << " went through after abort";
      } catch (const AbortedError& e) {
        EXPECT_NE(std::string(e.what()).find("aborted on purpose"), std::string::npos) << what << ": " << e.what();
      }
    };
    expect_aborted("allreduce", [&] { comm->allreduce(buf.get(), buf.get(), 2, DataType::kFloat32, ReduceOp::kSum); });
    expect_aborted("allreduce_async", [&] {
      comm->allreduce_async(buf.get(), buf.get(), 2, DataType::kFloat32, ReduceOp::kSum)->wait();
    });
    expect_aborted("barrier", [&] { comm->barrier(); });
    expect_aborted("synchronize", [&] { gpu::synchronize(*comm); });
    EXPECT_TRUE(before->test());  // it had ended: its result stands
    EXPECT_EQ(before->exception(), nullptr);
  });
}

// DDP's GPU buckets through the same stream rules: after finish() (which waits in stream order) the
// averaged gradients are right when read in stream order, and with timing on the overlap figure says
// when each bucket's allreduce ran. Iteration 1: every allreduce has ended before finish() marks the
// end of backward, so all of it overlapped (1.0). Iteration 2: rank 1 joins only after rank 0's
// finish(), so rank 0's allreduces ran after its backward ended: next to none of it overlapped.
TEST(GpuStreams, GradientSyncWaitsInStreamOrderAndTimesItsBuckets) {
  auto store = make_memory_store();
  std::atomic<bool> rank0_finished{false};
  run_ranks(2, [&](int rank) {
    auto comm = device_comm(store, rank, 2);
    gpu::enable_timing(*comm);
    std::vector<train::ParameterSpec> params = {{"w1", {64}}, {"w2", {32}}};
    train::GradSyncOptions so;
    so.memory = train::gpu_bucket_memory(rank);
    so.first_bucket_cap_bytes = 32 * sizeof(float);  // w2 alone, then w1 alone: two buckets
    so.bucket_cap_bytes = 32 * sizeof(float);
    so.rebuild_buckets = false;
    train::GradientSync sync(comm, params, so);
    std::vector<std::shared_ptr<void>> grads;
    for (const auto& p : params) grads.push_back(device_floats(std::vector<float>(p.numel(), rank + 1.0f), rank));
    auto backward = [&] {
      for (size_t i = params.size(); i-- > 0;) sync.mark_ready(i, static_cast<const float*>(grads[i].get()));
    };
    std::vector<std::vector<float>> averaged(params.size());
    auto read_back = [&](size_t i, const float* avg) {
      averaged[i].resize(params[i].numel());
      gpu::copy_memory(averaged[i].data(), avg, averaged[i].size() * sizeof(float));
    };

    backward();
    gpu::synchronize(*comm);  // both buckets' allreduces have ended before backward "ends"
    sync.finish(read_back);
    for (const auto& a : averaged)
      for (float v : a) EXPECT_FLOAT_EQ(v, 1.5f);  // read_back's copies came after the marker
    const train::GradSyncStats first = sync.stats();
    EXPECT_EQ(first.gpu_timed_buckets, 2) << "each bucket's allreduce should have a GPU interval";
    EXPECT_DOUBLE_EQ(first.gpu_overlap_share(), 1.0);

    if (rank == 1) {
      EXPECT_TRUE(becomes_true(rank0_finished, 20s));
    }
    backward();
    if (rank == 1) std::this_thread::sleep_for(20ms);
    sync.finish([](size_t, const float*) {});  // no host read here: it would wait for the allreduce
    if (rank == 0) {
      std::this_thread::sleep_for(200ms);  // rank 0's allreduces wait for rank 1 meanwhile
      rank0_finished = true;
    }
    gpu::synchronize(*comm);
    std::vector<float> one(1);  // a read in the caller's stream: its end-of-backward marker has run too
    gpu::copy_memory(one.data(), grads[0].get(), sizeof(float));
    const train::GradSyncStats second = sync.stats();
    EXPECT_EQ(second.gpu_timed_buckets, 4) << "rank " << rank;
    if (rank == 0) {
      const double share = (second.gpu_overlap_sum - first.gpu_overlap_sum) / 2;
      EXPECT_LT(share, 0.2) << "rank 0's allreduces ran after its backward had ended";
    }
  });
}

// One rank normally skips the buckets; COHORT_DDP_REDUCE_ONE_RANK=1 sends them through NCCL as N ranks
// would (PyTorch DDP does), so that one GPU can measure the overlap.
TEST(GpuStreams, OneRankCanReduceItsBucketsToMeasureOverlap) {
  setenv("COHORT_DDP_REDUCE_ONE_RANK", "1", 1);
  auto comm = device_comm(make_memory_store(), 0, 1);
  gpu::enable_timing(*comm);
  std::vector<train::ParameterSpec> params = {{"w1", {64}}, {"w2", {32}}};
  train::GradSyncOptions so;
  so.memory = train::gpu_bucket_memory(0);
  so.first_bucket_cap_bytes = 32 * sizeof(float);
  so.bucket_cap_bytes = 32 * sizeof(float);
  so.rebuild_buckets = false;
  train::GradientSync sync(comm, params, so);
  EXPECT_NE(sync.gradient_slot(0), nullptr) << "one rank that reduces keeps its gradients in buckets";
  std::vector<std::shared_ptr<void>> grads;
  for (const auto& p : params) grads.push_back(device_floats(std::vector<float>(p.numel(), 4.0f), 0));
  for (size_t i = params.size(); i-- > 0;) sync.mark_ready(i, static_cast<const float*>(grads[i].get()));
  std::vector<float> w1(64);
  sync.finish([&](size_t i, const float* avg) {
    if (i == 0) gpu::copy_memory(w1.data(), avg, w1.size() * sizeof(float));
  });
  EXPECT_EQ(w1, std::vector<float>(64, 4.0f));
  gpu::synchronize(*comm);
  EXPECT_EQ(sync.stats().gpu_timed_buckets, 2);
  unsetenv("COHORT_DDP_REDUCE_ONE_RANK");
}

}  // namespace
}  // namespace cohort::test
