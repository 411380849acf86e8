// `cohort bench ... --device cuda` through `cohort run`, against the fake CUDA/NCCL library: the
// table, --check on GPU buffers, the staged path across real processes, and the one-line refusals.
#include <gtest/gtest.h>

#include "support/test_support.h"

namespace cohort::test {
namespace {

std::vector<std::string> fake_env() {
  return {std::string("COHORT_CUDA_RUNTIME=") + COHORT_FAKE_CUDA, std::string("COHORT_NCCL_LIBRARY=") + COHORT_FAKE_CUDA};
}

TEST(GpuBenchFake, StagedAcrossProcessesChecksEveryDtype) {
  for (const char* dtype : {"float", "int32", "half", "bfloat16"}) {
    auto r = run_process({cohort_tool(), "run", "-n", "3", "--no-tag-output", cohort_tool(), "bench", "allreduce",
                          "--device", "cuda", "--gpu-path", "staged", "-b", "8", "-e", "64K", "-f", "16", "-d", dtype,
                          "--check", "--min-time", "0.02", "--trials", "1"},
                         fake_env(), 60);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("# buffers: GPU memory (device 0 of rank 0; staged:"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("# Out of bounds values : 0 OK"), std::string::npos) << r.out;
  }
}

TEST(GpuBenchFake, OneRankNcclEveryCollective) {
  for (const char* op : {"allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "sendrecv"}) {
    auto r = run_process({cohort_tool(), "run", "-n", "1", cohort_tool(), "bench", op, "--device", "cuda", "-b", "64",
                          "-e", "64K", "-f", "32", "--check", "--min-time", "0.02", "--trials", "1"},
                         fake_env(), 60);
    ASSERT_EQ(r.exit_code, 0) << op << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("nccl: NCCL 2.28.9, one GPU per rank"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("# Out of bounds values : 0 OK"), std::string::npos) << r.out;
  }
}

TEST(GpuBenchFake, BadDeviceFlagIsOneLine) {
  auto r = run_process({cohort_tool(), "bench", "allreduce", "--device", "tpu"}, fake_env(), 30);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, "cohort bench allreduce: --device tpu: expected cpu or cuda\n");
}

}  // namespace
}  // namespace cohort::test
