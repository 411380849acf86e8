// The Open MPI peer of issue 51's side-by-side (bench/peers/bench_mpi.c), built as
// bench/coll_side_by_side.sh builds it: with --no-cache-reuse every buffer set it rotates through must
// be memory of its own. Its input sets were malloc'd and zeroed with memset, which the compiler turns
// into calloc; never written, every page of them read the kernel's one zero page (in the cache), and
// Open MPI's 64 MiB allgather and alltoall ran ahead of any copy from memory (docs/algorithms-shm.md,
// "The copy limit").
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "support/test_support.h"

namespace cohort {
namespace {

using test::run_process;

TEST(PeerBench, OpenMpiBenchKeepsEveryRotatedBufferSetInMemory) {
  if (run_process({"sh", "-c", "command -v mpicc"}).exit_code != 0)
    GTEST_SKIP() << "mpicc is not installed (Debian: libopenmpi-dev), so bench/peers/bench_mpi.c cannot be built";
  test::TempDir dir;
  const std::string bench = dir.file("bench_mpi");
  // The command of bench/coll_side_by_side.sh: at -O2 the compiler folds malloc + memset into calloc.
  auto built = run_process({"mpicc", "-O2", "-o", bench, std::string(COHORT_SOURCE_DIR) + "/bench/peers/bench_mpi.c", "-lm"},
                           {}, 120);
  ASSERT_EQ(built.exit_code, 0) << built.out << built.err;
  // One rank (an MPI singleton, no mpirun), 1 MiB: sets of 1 MiB in + 1 MiB out (each a fresh mapping
  // of its own, as the 64 MiB ones are), more than twice the L3 of them; one short trial.
  for (std::string op : {"alltoall"}) {  // the timed calls only read its input sets
    auto r = run_process({bench, op, "1048576", "1", "0.01", "", "no-cache-reuse"}, {}, 120);
    ASSERT_EQ(r.exit_code, 0) << op << "\n" << r.out << r.err;
    std::smatch m;
    const std::regex line(R"(# 1048576 B: (\d+) buffer sets, \d+ MiB per rank; sets 1-\d+: (\d+) MiB, (\d+) MiB of them in memory)");
    ASSERT_TRUE(std::regex_search(r.out, m, line)) << op << ": no line on the buffer sets\n" << r.out;
    EXPECT_GE(std::stoi(m[1]), 2) << r.out;
    // All of them, within a MiB of rounding (the growth also counts the allocator's own pages).
    EXPECT_GE(std::stoll(m[3]) + 1, std::stoll(m[2])) << op << ": the rotated sets are not all in memory\n" << r.out;
    EXPECT_NE(r.out.find("RESULT peer=mpi op=" + op + " n=1 bytes=1048576"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace cohort
