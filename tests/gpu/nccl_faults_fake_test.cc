// What real NCCL does and a lenient test double would hide, against the strict fake
// (tests/gpu/fake_cuda.cc), and cohort's answer to each:
// - a hung NCCL call (a lazy connection to a peer that never answers) must not lock out the
//   watchdog: it ends the job's stuck operation at its deadline, and the abort ends the hung call;
// - an abort that is slow (ncclCommAbort waits for a busy GPU) does not hold up the error;
// - a communicator whose set-up finishes after cohort gave up on it is aborted, not leaked;
// - NCCL's sends wait for their receives: the exchanges cohort makes of several sends and receives
//   (alltoall, gather, scatter) are grouped, where an ungrouped exchange deadlocks;
// - GPU memory is not host memory: host code that touches it crashes.
// Each runs with cohort's non-blocking communicators (NCCL >= 2.14) and, where it differs, with the
// blocking ones an older NCCL gives (FAKE_NCCL_VERSION=21300).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <thread>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/gpu.h"
#include "store/memory_store.h"
#include "fake_gpu.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// The fake's test hooks (see the end of fake_cuda.cc).
struct FakeHooks {
  void (*stall)(int device, const char* function, int count);
  int (*stalls_ended_by_abort)();
  void (*delay_init)(int ms);
  void (*slow_abort)(int ms);
  int (*live_comms)();
  FakeHooks() {
    void* h = dlopen(COHORT_FAKE_CUDA, RTLD_NOW);
    EXPECT_NE(h, nullptr) << dlerror();
    stall = reinterpret_cast<decltype(stall)>(dlsym(h, "fake_nccl_stall"));
    stalls_ended_by_abort =
        reinterpret_cast<decltype(stalls_ended_by_abort)>(dlsym(h, "fake_nccl_stalls_ended_by_abort"));
    delay_init = reinterpret_cast<decltype(delay_init)>(dlsym(h, "fake_nccl_delay_init"));
    slow_abort = reinterpret_cast<decltype(slow_abort)>(dlsym(h, "fake_nccl_slow_abort"));
    live_comms = reinterpret_cast<decltype(live_comms)>(dlsym(h, "fake_nccl_live_comms"));
  }
};
FakeHooks& fake() {
  static FakeHooks f;
  return f;
}

// Blocking communicators: the fake says it is NCCL 2.13, which has no ncclCommInitRankConfig.
class NcclMode : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (blocking()) setenv("FAKE_NCCL_VERSION", "21300", 1);
  }
  void TearDown() override { unsetenv("FAKE_NCCL_VERSION"); }
  bool blocking() const { return GetParam(); }
};
std::string mode_name(const ::testing::TestParamInfo<bool>& info) { return info.param ? "Blocking" : "NonBlocking"; }

// Rank 1 stops calling. Rank 0's allreduce is queued (the watchdog follows it), then rank 0's next
// NCCL call hangs inside NCCL, as a lazy connection to the silent peer does. The watchdog must still
// end the allreduce at its deadline; its abort ends the hung call, which throws the cause. (Before
// the fix the hung call held the lock the watchdog needed: nothing ended until the fake's own 20 s
// safety limit.)
TEST_P(NcclMode, TheWatchdogEndsAJobWhoseNcclCallHangs) {
  auto store = make_memory_store();
  std::atomic<bool> rank0_done{false};
  const int ended_by_abort = fake().stalls_ended_by_abort();
  run_ranks(2, [&](int rank) {
    auto comm = device_comm(store, rank, 2, 600ms);
    auto buf = gpu::allocate_device(4 * sizeof(float), rank);
    comm->barrier();
    if (rank == 1) {
      EXPECT_TRUE(becomes_true(rank0_done, 30s));
      return;
    }
    struct Done {
      std::atomic<bool>& flag;
      ~Done() { flag = true; }
    } done{rank0_done};
    comm->allreduce(buf.get(), buf.get(), 4, DataType::kFloat32, ReduceOp::kSum);  // stuck: rank 1 never calls
    fake().stall(0, "ncclBroadcast", 1);
    const auto t0 = Clock::now();
    try {
      comm->broadcast(buf.get(), 4, DataType::kFloat32, 0);
      ADD_FAILURE() << "the hung broadcast returned normally";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("rank 0 (GPU 0): allreduce of 16 bytes did not finish on the GPU within 600 ms") !=
                      std::string::npos ||
                  what.find("rank 0 (GPU 0): NCCL could not start broadcast of 16 bytes within 600 ms") !=
                      std::string::npos)
          << what;
    }
    const auto waited = Clock::now() - t0;
    EXPECT_LT(waited, 3s) << "the hung call was not ended by the watchdog's abort";
    if (blocking()) {
      EXPECT_EQ(fake().stalls_ended_by_abort(), ended_by_abort + 1) << "the stall ran out on its own";
    }
    // The communicator is failed for good, and says why.
    EXPECT_THROW(comm->allreduce(buf.get(), buf.get(), 4, DataType::kFloat32, ReduceOp::kSum), AbortedError);
  });
}

// Rank 1 stops calling, and ncclCommAbort takes 3 s, as a real one does while the GPU is busy with
// work queued before the collective (seen on an H200: the abort returned when that work did, 57 s
// after the deadline). Rank 0's wait must still end at its deadline with the cause, not when the abort
// returns; the abort finishes on its own and leaves no communicator behind.
TEST(NcclFaults, ASlowAbortDoesNotHoldUpTheError) {
  auto store = make_memory_store();
  std::atomic<bool> rank0_done{false};
  const int live_before = fake().live_comms();
  fake().slow_abort(3000);
  struct Restore {
    ~Restore() { fake().slow_abort(0); }
  } restore;
  run_ranks(2, [&](int rank) {
    auto comm = device_comm(store, rank, 2, 500ms);
    auto buf = gpu::allocate_device(4 * sizeof(float), rank);
    comm->barrier();
    if (rank == 1) {
      EXPECT_TRUE(becomes_true(rank0_done, 30s));
      return;
    }
    const auto t0 = Clock::now();
    EXPECT_THROW(
        {
          comm->allreduce(buf.get(), buf.get(), 4, DataType::kFloat32, ReduceOp::kSum);
          gpu::synchronize(*comm);
        },
        TimeoutError);
    const auto waited = Clock::now() - t0;
    rank0_done = true;
    EXPECT_LT(waited, 2000ms) << "the error waited for the slow abort";
    EXPECT_THROW(comm->allreduce(buf.get(), buf.get(), 4, DataType::kFloat32, ReduceOp::kSum), AbortedError);
  });
  // The abort ends by itself, in the background.
  const auto until = Clock::now() + 10s;
  while (fake().live_comms() > live_before && Clock::now() < until) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(fake().live_comms(), live_before) << "an aborted communicator was left alive";
}

// Every rank gives up on NCCL's set-up at the communicator's timeout (400 ms); the set-up itself
// succeeds later (1.5 s). The late communicators must be aborted, not left holding GPU memory and
// NCCL's threads for the rest of the process.
TEST_P(NcclMode, ACommunicatorSetUpAfterTheTimeoutIsAbortedNotLeaked) {
  auto store = make_memory_store();
  const int live_before = fake().live_comms();
  fake().delay_init(1500);
  struct Undelay {
    ~Undelay() { fake().delay_init(0); }
  } undelay;
  run_ranks(2, [&](int rank) {
    try {
      device_comm(store, rank, 2, 400ms);
      ADD_FAILURE() << "the set-up did not time out";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(rank) + " (GPU " + std::to_string(rank) +
                                           "): NCCL communicator set-up did not finish within 400 ms"),
                std::string::npos)
          << e.what();
    }
  });
  const auto end = Clock::now() + 6s;
  while (fake().live_comms() > live_before && Clock::now() < end) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(fake().live_comms(), live_before) << "a communicator whose set-up finished late was leaked";
}

INSTANTIATE_TEST_SUITE_P(GpuFaults, NcclMode, ::testing::Values(false, true), mode_name);

// Messages above the fake's eager size (64 KiB): each send waits for its receive, as NCCL's do.
// alltoall, gather and scatter move several at once between the same ranks; ungrouped, rank 0's
// send to 1 and rank 1's send to 0 would wait for each other forever.
TEST(GpuFaults, ExchangesOfLargeMessagesAreGroupedAndComplete) {
  const int world = 3;
  const size_t n = 20000;  // floats per block: 80 KB
  auto store = make_memory_store();
  run_ranks(world, [&](int rank) {
    auto comm = device_comm(store, rank, world, 5s);
    std::vector<float> mine(n * world);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<float>(rank * 1000000 + i);
    auto send = gpu::allocate_device(mine.size() * sizeof(float), rank);
    auto recv = gpu::allocate_device(mine.size() * sizeof(float), rank);
    gpu::copy_memory(send.get(), mine.data(), mine.size() * sizeof(float));
    std::vector<float> out(n * world);

    comm->alltoall(send.get(), recv.get(), n, DataType::kFloat32);
    gpu::copy_memory(out.data(), recv.get(), out.size() * sizeof(float));
    for (int from = 0; from < world; ++from)  // block `from` holds rank from's block `rank`
      EXPECT_EQ(out[from * n + 7], static_cast<float>(from * 1000000 + rank * n + 7)) << "alltoall, from " << from;

    comm->gather(send.get(), recv.get(), n, DataType::kFloat32, 1);
    if (rank == 1) {
      gpu::copy_memory(out.data(), recv.get(), out.size() * sizeof(float));
      for (int from = 0; from < world; ++from)
        EXPECT_EQ(out[from * n + 3], static_cast<float>(from * 1000000 + 3)) << "gather, from " << from;
    }

    comm->scatter(send.get(), recv.get(), n, DataType::kFloat32, 2);
    gpu::copy_memory(out.data(), recv.get(), n * sizeof(float));
    EXPECT_EQ(out[5], static_cast<float>(2 * 1000000 + rank * n + 5)) << "scatter";
    gpu::synchronize(*comm);
  });
}

// The same messages exchanged with plain send and recv, both ranks sending first: NCCL deadlocks,
// and so does the fake (the control that shows it is strict). The deadline ends it, rank named.
TEST(GpuFaults, AnUngroupedExchangeOfLargeMessagesDeadlocksUntilTheDeadline) {
  const size_t n = 20000;
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    auto comm = device_comm(store, rank, 2, 700ms);
    auto out = gpu::allocate_device(n * sizeof(float), rank);
    auto in = gpu::allocate_device(n * sizeof(float), rank);
    const auto t0 = Clock::now();
    try {
      comm->send(out.get(), n, DataType::kFloat32, 1 - rank, 0);
      comm->recv(in.get(), n, DataType::kFloat32, 1 - rank, 0);
      gpu::synchronize(*comm);
      ADD_FAILURE() << "rank " << rank << ": an ungrouped exchange of large messages completed";
    } catch (const Error& e) {
      // The watchdog names the send; synchronize() may reach its own deadline first.
      const std::string what = e.what();
      EXPECT_NE(what.find("rank " + std::to_string(rank) + " (GPU " + std::to_string(rank) + "): "), std::string::npos)
          << what;
      EXPECT_NE(what.find("did not finish on the GPU within 700 ms"), std::string::npos) << what;
    }
    EXPECT_LT(Clock::now() - t0, 4s);
  });
}

// Host code that reads GPU memory directly crashes, as on a GPU (where the address is not host
// memory at all); the same bytes read through cudaMemcpy are there.
TEST(GpuFaults, HostCodeCannotTouchGpuMemory) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto p = gpu::allocate_device(sizeof(float), 0);
  const float one = 1.0f;
  gpu::copy_memory(p.get(), &one, sizeof one);
  float back = 0;
  gpu::copy_memory(&back, p.get(), sizeof back);
  EXPECT_EQ(back, 1.0f);
  EXPECT_DEATH(
      {
        volatile float v = *static_cast<volatile float*>(p.get());
        (void)v;
      },
      "");
}

}  // namespace
}  // namespace cohort::test
