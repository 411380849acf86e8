// The GPU communicator against libcohort_fake_cuda.so (ctest points COHORT_CUDA_RUNTIME and
// COHORT_NCCL_LIBRARY at it): ranks as threads, each on its own fake device, host communicators over
// cohort's real transports. What it proves: device and host buffers are told apart and routed, every
// operation reaches NCCL with the right arguments (results equal the reference), the unique id is
// shared, the staged path gives the same results, and a stuck or mismatched operation ends in a
// bounded time with the rank named. The real NCCL on a real GPU is gpu_tests' job (scripts/gpu_check.sh).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <cmath>
#include <numeric>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/gpu.h"
#include "store/memory_store.h"
#include "fake_gpu.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

using gpu::DeviceOptions;
using gpu::DevicePath;

std::shared_ptr<Communicator> host_comm(std::shared_ptr<Store> store, int rank, int world,
                                        std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  CommOptions o;
  o.timeout = timeout;
  return Communicator::create(store, rank, world, o);
}

// Device memory holding `values` (floats).
std::shared_ptr<void> on_device(const std::vector<float>& values, int device) {
  auto p = gpu::allocate_device(values.size() * sizeof(float), device);
  gpu::copy_memory(p.get(), values.data(), values.size() * sizeof(float));
  return p;
}
std::vector<float> to_host(const void* p, size_t n) {
  std::vector<float> out(n);
  gpu::copy_memory(out.data(), p, n * sizeof(float));
  return out;
}

TEST(GpuFake, StatusSeesTheFakeLibraries) {
  auto s = gpu::status();
  ASSERT_TRUE(s.usable()) << s.why_no_gpu;
  EXPECT_EQ(s.devices, 8);
  EXPECT_TRUE(s.nccl) << s.why_no_nccl;
  EXPECT_EQ(s.nccl_version, 22809);
  EXPECT_NE(s.runtime_library.find("fake_cuda"), std::string::npos);
  auto d = gpu::allocate_device(64, 3);
  EXPECT_TRUE(gpu::is_device_pointer(d.get()));
  std::vector<float> h(4);
  EXPECT_FALSE(gpu::is_device_pointer(h.data()));
}

// Every collective on device buffers, NCCL path, 3 ranks.
TEST(GpuFake, NcclPathCollectivesMatchTheReference) {
  const int world = 3;
  auto store = make_memory_store();
  run_ranks(world, [&](int rank) {
    auto comm = gpu::make_device_communicator(host_comm(store, rank, world), DeviceOptions{rank, DevicePath::kAuto});
    EXPECT_EQ(gpu::device_path_of(*comm).rfind("nccl: NCCL 2.28.9", 0), 0u) << gpu::device_path_of(*comm);
    const size_t n = 5;
    std::vector<float> mine(n);
    for (size_t i = 0; i < n; ++i) mine[i] = static_cast<float>(rank * 10 + i);

    auto buf = on_device(mine, rank);
    comm->allreduce(buf.get(), buf.get(), n, DataType::kFloat32, ReduceOp::kSum);
    for (size_t i = 0; i < n; ++i) EXPECT_FLOAT_EQ(to_host(buf.get(), n)[i], 30.0f + 3.0f * i);

    auto avg = on_device(mine, rank);
    comm->allreduce_async(avg.get(), avg.get(), n, DataType::kFloat32, ReduceOp::kAvg)->wait();
    EXPECT_FLOAT_EQ(to_host(avg.get(), n)[1], 11.0f);

    auto mx = on_device(mine, rank);
    auto mn = on_device(mine, rank);
    comm->allreduce(mx.get(), mx.get(), n, DataType::kFloat32, ReduceOp::kMax);  // cohort's kMax is NCCL's 2
    comm->allreduce(mn.get(), mn.get(), n, DataType::kFloat32, ReduceOp::kMin);
    EXPECT_FLOAT_EQ(to_host(mx.get(), n)[0], 20.0f);
    EXPECT_FLOAT_EQ(to_host(mn.get(), n)[0], 0.0f);

    auto b = on_device(mine, rank);
    comm->broadcast(b.get(), n, DataType::kFloat32, 2);
    EXPECT_FLOAT_EQ(to_host(b.get(), n)[4], 24.0f);

    auto gathered = gpu::allocate_device(n * world * sizeof(float), rank);
    comm->allgather(buf.get(), gathered.get(), n, DataType::kFloat32);  // buf holds the sums: all equal
    EXPECT_FLOAT_EQ(to_host(gathered.get(), n * world)[n * 2 + 1], 33.0f);

    std::vector<float> blocks(n * world);
    for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<float>(i + rank);
    auto rs_in = on_device(blocks, rank);
    auto rs_out = gpu::allocate_device(n * sizeof(float), rank);
    comm->reduce_scatter(rs_in.get(), rs_out.get(), n, DataType::kFloat32, ReduceOp::kSum);
    // Block `rank`, element 0: sum over r of (rank*n + r) = 3*rank*n + 3.
    EXPECT_FLOAT_EQ(to_host(rs_out.get(), n)[0], static_cast<float>(3 * rank * n + 3));

    auto red = on_device(mine, rank);
    auto red_out = gpu::allocate_device(n * sizeof(float), rank);
    comm->reduce(red.get(), red_out.get(), n, DataType::kFloat32, ReduceOp::kSum, 1);
    if (rank == 1) {
      EXPECT_FLOAT_EQ(to_host(red_out.get(), n)[2], 36.0f);
    }

    auto g_out = gpu::allocate_device(n * world * sizeof(float), rank);
    comm->gather(red.get(), g_out.get(), n, DataType::kFloat32, 0);
    if (rank == 0) {
      EXPECT_FLOAT_EQ(to_host(g_out.get(), n * world)[n * 2], 20.0f);
    }

    auto sc_out = gpu::allocate_device(n * sizeof(float), rank);
    comm->scatter(rs_in.get(), sc_out.get(), n, DataType::kFloat32, 1);  // root 1's blocks: i + 1
    EXPECT_FLOAT_EQ(to_host(sc_out.get(), n)[0], static_cast<float>(rank * n + 1));

    auto a2a_out = gpu::allocate_device(n * world * sizeof(float), rank);
    comm->alltoall(rs_in.get(), a2a_out.get(), n, DataType::kFloat32);
    // Block r of my output is block `rank` of rank r's input: rank*n + j + r.
    EXPECT_FLOAT_EQ(to_host(a2a_out.get(), n * world)[n * 2 + 1], static_cast<float>(rank * n + 1 + 2));

    // allgatherv: rank r contributes r+1 elements.
    std::vector<size_t> counts{1, 2, 3};
    std::vector<float> part(static_cast<size_t>(rank + 1), static_cast<float>(rank + 100));
    auto v_in = on_device(part, rank);
    auto v_out = gpu::allocate_device(6 * sizeof(float), rank);
    comm->allgatherv(v_in.get(), part.size(), v_out.get(), counts, DataType::kFloat32);
    EXPECT_EQ(to_host(v_out.get(), 6), (std::vector<float>{100, 101, 101, 102, 102, 102}));

    // A ring of send/recv.
    auto s_buf = on_device(mine, rank);
    auto r_buf = gpu::allocate_device(n * sizeof(float), rank);
    const int right = (rank + 1) % world, left = (rank + world - 1) % world;
    if (rank % 2 == 0) {
      comm->send(s_buf.get(), n, DataType::kFloat32, right);
      comm->recv(r_buf.get(), n, DataType::kFloat32, left);
    } else {
      comm->recv(r_buf.get(), n, DataType::kFloat32, left);
      comm->send(s_buf.get(), n, DataType::kFloat32, right);
    }
    EXPECT_FLOAT_EQ(to_host(r_buf.get(), n)[0], static_cast<float>(left * 10));

    // Host buffers on the same communicator take cohort's own collectives.
    std::vector<double> host(3, rank + 1.0);
    comm->allreduce(host.data(), host.data(), 3, DataType::kFloat64, ReduceOp::kSum);
    EXPECT_DOUBLE_EQ(host[0], 6.0);
    comm->barrier();
  });
}

// cohort's in-place forms (send == recv) mean what include/cohort/communicator.h says on both GPU
// paths: an allgather's contribution is already at recv + rank * count; a reduce-scatter's input is
// recv and its result goes to recv's first block. NCCL's own in-place convention differs (the input
// is this rank's block), so the NCCL path translates; the sharded optimizer relies on both forms.
TEST(GpuFake, InPlaceAllgatherAndReduceScatterKeepCohortsMeaningOnBothPaths) {
  const int world = 3;
  const size_t n = 4;
  for (DevicePath path : {DevicePath::kAuto, DevicePath::kStaged}) {
    auto store = make_memory_store();
    run_ranks(world, [&](int rank) {
      auto comm = gpu::make_device_communicator(host_comm(store, rank, world), DeviceOptions{rank, path});
      for (bool async : {false, true}) {
        // Allgather: rank r's block holds r * 100 + i; the other blocks hold garbage (-1).
        std::vector<float> blocks(n * world, -1.0f);
        for (size_t i = 0; i < n; ++i) blocks[size_t(rank) * n + i] = float(rank * 100) + float(i);
        auto ag = on_device(blocks, rank);
        if (async) comm->allgather_async(ag.get(), ag.get(), n, DataType::kFloat32)->wait();
        else comm->allgather(ag.get(), ag.get(), n, DataType::kFloat32);
        auto got = to_host(ag.get(), n * world);
        for (size_t j = 0; j < n * world; ++j)
          EXPECT_FLOAT_EQ(got[j], float((j / n) * 100 + j % n)) << gpu::device_path_of(*comm) << ", element " << j;
        // Reduce-scatter averaging element j = j + rank: block `rank` of the average, in the first block.
        std::vector<float> input(n * world);
        for (size_t j = 0; j < input.size(); ++j) input[j] = float(j) + float(rank);
        auto rs = on_device(input, rank);
        if (async) comm->reduce_scatter_async(rs.get(), rs.get(), n, DataType::kFloat32, ReduceOp::kAvg)->wait();
        else comm->reduce_scatter(rs.get(), rs.get(), n, DataType::kFloat32, ReduceOp::kAvg);
        auto first = to_host(rs.get(), n);
        for (size_t i = 0; i < n; ++i)
          EXPECT_FLOAT_EQ(first[i], float(size_t(rank) * n + i) + 1.0f) << gpu::device_path_of(*comm) << ", element " << i;
      }
    });
  }
}

TEST(GpuFake, BadBuffersAreOneClearError) {
  const int world = 2;
  auto store = make_memory_store();
  run_ranks(world, [&](int rank) {
    auto comm = gpu::make_device_communicator(host_comm(store, rank, world), DeviceOptions{rank, DevicePath::kAuto});
    auto dev = gpu::allocate_device(16, rank);
    std::vector<float> host(4);
    try {
      comm->allreduce(dev.get(), host.data(), 4, DataType::kFloat32, ReduceOp::kSum);
      ADD_FAILURE() << "mixed buffers accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_STREQ(e.what(), "allreduce: some buffers are in GPU memory and some in host memory; pass all of them on "
                             "one side");
    }
    auto other = gpu::allocate_device(16, 7);
    try {
      comm->broadcast(other.get(), 4, DataType::kFloat32, 0);
      ADD_FAILURE() << "buffer of another GPU accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()),
                "broadcast: a buffer is on GPU 7 but rank " + std::to_string(rank) + " communicates on GPU " +
                    std::to_string(rank));
    }
    try {
      comm->send(dev.get(), 4, DataType::kFloat32, 1 - rank, 5);
      ADD_FAILURE() << "tag accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("NCCL has no tags"), std::string::npos) << e.what();
    }
    // InvalidArgument leaves the communicator usable.
    comm->allreduce(dev.get(), dev.get(), 4, DataType::kFloat32, ReduceOp::kSum);
  });
}

// Staged through host memory: asked for, and chosen because two ranks share a GPU.
TEST(GpuFake, StagedPathGivesTheSameResults) {
  const int world = 3;
  for (bool shared_gpu : {false, true}) {
    auto store = make_memory_store();
    run_ranks(world, [&](int rank) {
      DeviceOptions o{shared_gpu ? 0 : rank, shared_gpu ? DevicePath::kAuto : DevicePath::kStaged};
      auto comm = gpu::make_device_communicator(host_comm(store, rank, world), o);
      const std::string path = gpu::device_path_of(*comm);
      if (shared_gpu) {
        EXPECT_EQ(path, "staged: ranks 0 and 1 share GPU 0000:01:00.0 on " + comm->host_of(1) +
                            " (NCCL needs a GPU of its own per rank)");
      } else {
        EXPECT_EQ(path.rfind("staged:", 0), 0u) << path;
      }
      const int dev = o.device;
      std::vector<float> mine{1.0f * rank, 2.0f, 3.0f};
      auto buf = on_device(mine, dev);
      comm->allreduce(buf.get(), buf.get(), 3, DataType::kFloat32, ReduceOp::kSum);
      EXPECT_EQ(to_host(buf.get(), 3), (std::vector<float>{3, 6, 9}));
      auto w = comm->allreduce_async(buf.get(), buf.get(), 3, DataType::kFloat32, ReduceOp::kAvg);
      w->wait();
      EXPECT_EQ(to_host(buf.get(), 3), (std::vector<float>{3, 6, 9}));
      auto b = on_device({static_cast<float>(rank)}, dev);
      comm->broadcast(b.get(), 1, DataType::kFloat32, 2);
      EXPECT_EQ(to_host(b.get(), 1)[0], 2.0f);
      auto all = gpu::allocate_device(3 * sizeof(float), dev);
      comm->allgather(b.get(), all.get(), 1, DataType::kFloat32);
      EXPECT_EQ(to_host(all.get(), 3), (std::vector<float>{2, 2, 2}));
    });
  }
}

TEST(GpuFake, NcclAskedForButRanksShareAGpu) {
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    try {
      gpu::make_device_communicator(host_comm(store, rank, 2), DeviceOptions{0, DevicePath::kNccl});
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("GPU communicator: NCCL was asked for, but ranks 0 and 1 share GPU"),
                std::string::npos)
          << e.what();
    }
  });
}

// Rank 1 never joins the allreduce. Rank 0's blocking call returns once the work is queued (stream
// order); its next host synchronisation ends at the deadline, NCCL aborted, with itself and the
// operation named; the copy that was ordered after the allreduce is not stuck; later calls repeat
// the cause.
TEST(GpuFake, StuckOperationEndsAtTheDeadline) {
  auto store = make_memory_store();
  std::atomic<bool> rank0_done{false};
  run_ranks(2, [&](int rank) {
    auto comm = gpu::make_device_communicator(host_comm(store, rank, 2, std::chrono::milliseconds(1500)),
                                              DeviceOptions{rank, DevicePath::kAuto});
    auto buf = gpu::allocate_device(4 * sizeof(float), rank);
    comm->barrier();
    if (rank == 1) {  // alive, but never calls (a stopped or hung peer)
      while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    }
    struct Done {
      std::atomic<bool>& flag;
      ~Done() { flag = true; }
    } done{rank0_done};
    const auto t0 = std::chrono::steady_clock::now();
    auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    comm->allreduce(buf.get(), buf.get(), 4, DataType::kFloat32, ReduceOp::kSum);
    EXPECT_LT(seconds(), 1.0) << "a blocking GPU call waits in stream order, not on the host";
    std::vector<float> host(4, -1.0f);
    gpu::copy_memory(host.data(), buf.get(), sizeof(float) * 4);  // ordered after the allreduce
    EXPECT_GT(seconds(), 1.2) << "the copy ran before the allreduce it was ordered after";
    try {
      gpu::synchronize(*comm);
      ADD_FAILURE() << "no timeout";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 (GPU 0): allreduce of 16 bytes did not finish on the GPU within "
                                           "1500 ms; the NCCL communicator was aborted"),
                std::string::npos)
          << e.what();
    }
    EXPECT_LT(seconds(), 5.0);
    try {
      comm->allreduce(buf.get(), buf.get(), 4, DataType::kFloat32, ReduceOp::kSum);
      ADD_FAILURE() << "a failed communicator accepted work";
    } catch (const AbortedError& e) {
      EXPECT_NE(std::string(e.what()).find("did not finish on the GPU"), std::string::npos) << e.what();
    }
  });
}

// Ranks that call different sizes: NCCL's asynchronous error reaches both, with the rank named; the
// first to see it names the mismatch, the other may only see that its peer aborted.
TEST(GpuFake, AsynchronousNcclErrorIsReported) {
  auto store = make_memory_store();
  std::atomic<int> named_mismatch{0};
  run_ranks(2, [&](int rank) {
    auto comm = gpu::make_device_communicator(host_comm(store, rank, 2), DeviceOptions{rank, DevicePath::kAuto});
    auto buf = gpu::allocate_device(8 * sizeof(float), rank);
    try {
      auto work = comm->allreduce_async(buf.get(), buf.get(), rank == 0 ? 4 : 8, DataType::kFloat32, ReduceOp::kSum);
      work->synchronize();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(rank) + " (GPU " + std::to_string(rank) +
                                           "): NCCL reports an error during allreduce"),
                std::string::npos)
          << e.what();
      if (std::string(e.what()).find("ranks called different collectives") != std::string::npos) ++named_mismatch;
    }
  });
  EXPECT_GE(named_mismatch.load(), 1);
}

}  // namespace
}  // namespace cohort::test
