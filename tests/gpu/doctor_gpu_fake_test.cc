// `cohort doctor`'s GPU checks against the fake CUDA/NCCL library, two "hosts" reached through an
// ssh shim that runs the command locally (the second host is told it has 4 GPUs, the first 8). The first,
// localhost, is this machine and is checked without ssh; 127.0.0.2 counts as another host.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "support/test_support.h"

namespace cohort::test {
namespace {

TEST(GpuDoctorFake, GpuTableAndUnequalGpuCounts) {
  TempDir dir;
  const std::string shim = dir.file("ssh");
  write_file(shim,
             "#!/bin/sh\n"
             "host=$1; shift\n"
             "[ \"$host\" = 127.0.0.2 ] && export FAKE_CUDA_DEVICES=4\n"
             "exec /bin/sh -c \"$1\"\n");
  chmod(shim.c_str(), 0755);
  std::vector<std::string> env = {std::string("COHORT_CUDA_RUNTIME=") + COHORT_FAKE_CUDA,
                                  std::string("COHORT_NCCL_LIBRARY=") + COHORT_FAKE_CUDA};
  auto r = run_process({cohort_tool(), "doctor", "-H", "localhost:1,127.0.0.2:1", "--ssh-command", shim,
                        "--master-port", "0", "--no-allreduce", "--probe-bytes", "64K", "--pings", "3"},
                       env, 60);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("nccl allreduce (local GPUs)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ok: 8 GPUs summed 1 float each"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ok: 4 GPUs summed 1 float each"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("FAIL gpus: GPUs per host differ: 4 on 127.0.0.2; 8 on localhost"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fix: pass --gpus-per-node 4"), std::string::npos) << r.out;
}

// A host with the CUDA runtime but no NVIDIA driver: the runtime says cudaErrorInsufficientDriver, and
// the doctor says what that means here. A driver older than the runtime gives the same error, told apart.
TEST(GpuDoctorFake, NoDriverIsSaidInPlainWords) {
  for (std::string driver : {"1", "old"}) {
    std::vector<std::string> env = {std::string("COHORT_CUDA_RUNTIME=") + COHORT_FAKE_CUDA,
                                    std::string("COHORT_NCCL_LIBRARY=") + COHORT_FAKE_CUDA,
                                    "FAKE_CUDA_NO_DRIVER=" + driver};
    auto r = run_process({cohort_tool(), "doctor", "--master-port", "0", "--no-allreduce", "--probe-bytes", "64K",
                          "--pings", "3"},
                         env, 60);
    const std::string why = driver == "1" ? "no GPU / no NVIDIA driver on this host (cudaGetDeviceCount: "
                                            "cudaErrorInsufficientDriver"
                                          : "the NVIDIA driver supports CUDA up to 12.2, older than the CUDA runtime "
                                            "13.0 (cudaGetDeviceCount: cudaErrorInsufficientDriver";
    EXPECT_NE(r.out.find("gpus: no GPU on any host (localhost: " + why), std::string::npos) << r.out << r.err;
  }
}

}  // namespace
}  // namespace cohort::test
