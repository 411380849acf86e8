// `cohort bench` for issue 51's large-message side-by-side: gather and scatter check clean, the link
// line says which copy path the large transfers take (single copy, or why not), and --no-cache-reuse
// rotates through buffer sets that outgrow the cache (here a stated 4 MiB one, to stay small and fast).
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "bench/bench_two_ranks.h"
#include "support/test_support.h"

namespace cohort {
namespace {

using test::run_two;

TEST(BenchLarge, GatherAndScatterCheckCleanAcrossTheSingleCopyLimitWithRotatedBuffers) {
  for (std::string op : {"gather", "scatter", "alltoall", "reduce_scatter"}) {
    // 64 KiB (under the 1 MiB single-copy limit: over the transports or the slots) and 2 MiB (over it);
    // root 1 for gather and scatter.
    auto r = run_two({"bench", op, "-b", "64K", "-e", "2M", "-f", "32", "-n", "3", "-w", "1", "--trials", "1", "-c",
                      "-r", "1", "--no-cache-reuse", "--cache-bytes", "4M"});
    ASSERT_EQ(r.rank0.exit_code, 0) << op << "\n" << r.rank0.out << r.rank0.err;
    ASSERT_EQ(r.rank1.exit_code, 0) << op << "\n" << r.rank1.out << r.rank1.err;
    EXPECT_NE(r.rank0.out.find("# Out of bounds values : 0 OK"), std::string::npos) << r.rank0.out;
    EXPECT_NE(r.rank0.out.find("large transfers: single copy (process_vm_readv"), std::string::npos) << r.rank0.out;
    // 2 x 4 MiB over 2 MiB + 2 MiB (alltoall's in and out) is 3 sets; over 64 KiB + 64 KiB, 65 sets.
    EXPECT_NE(r.rank0.out.find("--no-cache-reuse: each size rotates through buffer sets > 2 x the cache (4 MiB)"),
              std::string::npos)
        << r.rank0.out;
    if (op == "alltoall") {
      EXPECT_NE(r.rank0.out.find("# 2097152 B: 3 buffer sets, 12 MiB per rank"), std::string::npos) << r.rank0.out;
      EXPECT_NE(r.rank0.out.find("# 65536 B: 65 buffer sets"), std::string::npos) << r.rank0.out;
    }
  }
}

TEST(BenchLarge, TheLinkLineSaysWhenSingleCopyIsOff) {
  auto r = run_two({"bench", "allgather", "-b", "2M", "-e", "2M", "-n", "2", "-w", "1", "--trials", "1", "-c"},
                   {"COHORT_SHM_SINGLE_COPY=0"});
  ASSERT_EQ(r.rank0.exit_code, 0) << r.rank0.out << r.rank0.err;
  EXPECT_NE(r.rank0.out.find("# Out of bounds values : 0 OK"), std::string::npos) << r.rank0.out;
  EXPECT_NE(r.rank0.out.find("large transfers: off (COHORT_SHM_SINGLE_COPY=0)"), std::string::npos) << r.rank0.out;
}

}  // namespace
}  // namespace cohort
