// `cohort bench <op>` end to end: two real processes meeting through torchrun-style variables
// (rank 0 hosts the store), with --check, CSV and PNG output. Checks correctness and the output
// format only; the figures themselves are measured by hand (docs/perf-collectives.md).
#include <sched.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_two_ranks.h"
#include "support/test_support.h"

namespace cohort {
namespace {

using test::run_two;

TEST(BenchTool, EveryCollectiveChecksCleanWithCsvAndPlot) {
  test::TempDir dir;
  for (std::string op : {"allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "sendrecv"}) {
    const std::string csv = dir.file(op + ".csv"), png = dir.file(op + ".png");
    auto r = run_two({"bench", op, "-b", "8", "-e", "1M", "-f", "16", "-n", "3", "-w", "1", "--trials", "2", "-c",
                      "--csv", csv, "--plot", png});
    ASSERT_EQ(r.rank0.exit_code, 0) << op << "\n" << r.rank0.out << r.rank0.err;
    ASSERT_EQ(r.rank1.exit_code, 0) << op << "\n" << r.rank1.out << r.rank1.err;
    EXPECT_NE(r.rank0.out.find("algbw"), std::string::npos) << r.rank0.out;
    EXPECT_NE(r.rank0.out.find("# Out of bounds values : 0 OK"), std::string::npos) << r.rank0.out;
    EXPECT_EQ(r.rank1.out.find("algbw"), std::string::npos) << "only rank 0 prints the table";
    // 8 B .. 1 MiB by 16: 8, 128, 2K, 32K, 512K (sizes too small for the world are skipped).
    const std::string table = test::read_file(csv);
    EXPECT_NE(table.find("op,ranks,size_bytes"), std::string::npos);
    EXPECT_NE(table.find(op + ",2,524288,"), std::string::npos) << table;
    const std::string image = test::read_file(png);
    ASSERT_GT(image.size(), 8u);
    EXPECT_EQ(image.substr(1, 3), "PNG");
  }
}

// The bench's "# link:" line says how the communicator waits: without yielding where each rank is bound
// to a CPU of its own, yielding where the ranks may share CPUs (docs/algorithms-shm.md, "Whether a wait
// yields"); on shared memory it carries the link probe's figures too. Over TCP and over shared memory.
TEST(BenchTool, TheLinkLineSaysWhetherWaitsYieldAndWhatTheProbeMeasured) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  std::vector<std::string> cpus;  // the first two CPUs this test may use: one for each rank
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(std::to_string(c));
  const bool two_cpus = cpus.size() == 2;
  for (std::string transport : {"tcp", "auto"}) {
    const std::vector<std::string> args = {"bench", "allreduce", "-b", "8", "-e", "8", "-n", "3", "--trials", "1"};
    auto shared = run_two(args, {"COHORT_TRANSPORT=" + transport});
    ASSERT_EQ(shared.rank0.exit_code, 0) << shared.rank0.out << shared.rank0.err;
    EXPECT_NE(shared.rank0.out.find("CPU sets overlap"), std::string::npos) << transport << ": " << shared.rank0.out;
    if (transport == "auto") {
      EXPECT_NE(shared.rank0.out.find("another rank just wrote"), std::string::npos) << shared.rank0.out;
      // The probe's choice of copy into the slots, with the figures that made it.
      EXPECT_NE(shared.rank0.out.find(" ns = write "), std::string::npos) << shared.rank0.out;
      auto forced = run_two(args, {"COHORT_TRANSPORT=auto", "COHORT_SHM_COPY=streaming"});
      ASSERT_EQ(forced.rank0.exit_code, 0) << forced.rank0.out << forced.rank0.err;
      EXPECT_NE(forced.rank0.out.find("slots: streaming (COHORT_SHM_COPY=streaming)"), std::string::npos)
          << forced.rank0.out;
    }
    if (!two_cpus) continue;  // one CPU: no two ranks can have their own
    auto bound = run_two(args, {"COHORT_TRANSPORT=" + transport}, cpus);
    ASSERT_EQ(bound.rank0.exit_code, 0) << bound.rank0.out << bound.rank0.err;
    EXPECT_NE(bound.rank0.out.find("every local rank has CPUs of its own"), std::string::npos)
        << transport << ": " << bound.rank0.out;
  }
}

// Every rank prints its share of the single-copy path's copies: in a 2-rank broadcast of 2 MiB (above
// the 1 MiB single-copy size) the root writes half into the receiver while the receiver reads the other
// half, in each of the 4 calls (1 warm-up, 3 timed); with one CPU for both, the receiver reads it all.
TEST(BenchTool, EveryRankSaysWhatItCopiedOnTheSingleCopyPath) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  const bool splits = CPU_COUNT(&allowed) >= 2;
  auto r = run_two({"bench", "broadcast", "-b", "2M", "-e", "2M", "-n", "3", "-w", "1", "--trials", "1"},
                   {"COHORT_TRANSPORT=auto"});
  ASSERT_EQ(r.rank0.exit_code, 0) << r.rank0.out << r.rank0.err;
  ASSERT_EQ(r.rank1.exit_code, 0) << r.rank1.out << r.rank1.err;
  const std::string root = splits ? "0.00 MiB, written into peers 1.00 MiB" : "0.00 MiB, written into peers 0.00 MiB";
  const std::string receiver = splits ? "1.00 MiB, written into peers 0.00 MiB" : "2.00 MiB, written into peers 0.00 MiB";
  EXPECT_NE(r.rank0.out.find("# copies, rank 0: 4 single-copy calls; per call read from peers " + root),
            std::string::npos)
      << r.rank0.out;
  EXPECT_NE(r.rank1.out.find("# copies, rank 1: 4 single-copy calls; per call read from peers " + receiver),
            std::string::npos)
      << r.rank1.out;
}

// --buffers shared: the bench's buffers come from allocate_shared, so every byte a rank copies from or into
// its peer on the single-copy path goes through its mapping of the peer's buffer (docs/algorithms-shm.md,
// "From shared buffers"), and the results check clean; without it the kernel copies them all.
TEST(BenchTool, SharedBuffersAreCopiedThroughTheMappingAndCheckClean) {
  for (std::string op : {"allgather", "alltoall", "reduce_scatter", "gather", "scatter", "broadcast", "allreduce"}) {
    for (std::string buffers : {"shared", "private"}) {
      auto r = run_two({"bench", op, "-b", "2M", "-e", "2M", "-n", "2", "-w", "1", "--trials", "1", "-c", "--buffers",
                        buffers},
                       {"COHORT_TRANSPORT=auto"});
      ASSERT_EQ(r.rank0.exit_code, 0) << op << "\n" << r.rank0.out << r.rank0.err;
      ASSERT_EQ(r.rank1.exit_code, 0) << op << "\n" << r.rank1.out << r.rank1.err;
      EXPECT_NE(r.rank0.out.find("# Out of bounds values : 0 OK"), std::string::npos) << op << " " << buffers
                                                                                   << "\n" << r.rank0.out;
      if (op == "allreduce") continue;  // not a single-copy collective (in place on shared memory: no copy)
      // "per call read from peers X MiB, written into peers Y MiB (Z MiB of them mapped shared memory)":
      // Z = X + Y when shared (and some rank copies something), 0 when private.
      double mapped_sum = 0, moved_sum = 0;
      for (const std::string* out : {&r.rank0.out, &r.rank1.out}) {
        double read = 0, written = 0, mapped = 0;
        const size_t at = out->find("per call read from peers ");
        ASSERT_NE(at, std::string::npos) << op << " " << buffers << "\n" << *out;
        ASSERT_EQ(std::sscanf(out->c_str() + at, "per call read from peers %lf MiB, written into peers %lf MiB (%lf MiB",
                              &read, &written, &mapped),
                  3)
            << out->substr(at, 120);
        EXPECT_DOUBLE_EQ(mapped, buffers == "shared" ? read + written : 0.0) << op << " " << buffers << "\n" << *out;
        mapped_sum += mapped, moved_sum += read + written;
      }
      EXPECT_GT(moved_sum, 0) << op << " " << buffers;
      if (buffers == "shared") {
        EXPECT_GT(mapped_sum, 0) << op;
      }
    }
  }
  auto bad = test::run_process({test::cohort_tool(), "bench", "allgather", "--buffers", "pinned"}, {}, 30);
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--buffers pinned: expected private or shared"), std::string::npos) << bad.err;
}

TEST(BenchTool, NcclTestsSpellingsAndBadFlags) {
  auto ok = run_two({"bench", "allreduce", "-b", "1K", "-e", "4K", "-f", "2", "-n", "2", "-w", "0", "--trials", "1",
                     "-c", "1", "-d", "bfloat16", "-o", "avg"});
  ASSERT_EQ(ok.rank0.exit_code, 0) << ok.rank0.out << ok.rank0.err;
  EXPECT_NE(ok.rank0.out.find("bfloat16"), std::string::npos) << ok.rank0.out;
  EXPECT_NE(ok.rank0.out.find("avg"), std::string::npos) << ok.rank0.out;
  // Rejected before any communicator is built: exit code 2 and one line naming the problem.
  auto bad = test::run_process({test::cohort_tool(), "bench", "allreduce", "-d", "int32", "-o", "avg"}, {}, 30);
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("avg is not defined on int32"), std::string::npos) << bad.err;
  auto size = test::run_process({test::cohort_tool(), "bench", "allgather", "-b", "1X"}, {}, 30);
  EXPECT_EQ(size.exit_code, 2) << size.err;
}

// Every command group answers for itself: its commands with --help, a usage error without one.
TEST(BenchTool, CommandGroupsPrintTheirOwnHelp) {
  auto help = test::run_process({test::cohort_tool(), "bench", "--help"}, {}, 30);
  EXPECT_EQ(help.exit_code, 0) << help.err;
  EXPECT_NE(help.out.find("usage: cohort bench <command> [options]"), std::string::npos) << help.out;
  for (const char* cmd : {"bench allreduce", "bench memcpy", "bench store"})
    EXPECT_NE(help.out.find(cmd), std::string::npos) << cmd << "\n" << help.out;
  auto store = test::run_process({test::cohort_tool(), "store", "-h"}, {}, 30);
  EXPECT_EQ(store.exit_code, 0);
  EXPECT_NE(store.out.find("store serve"), std::string::npos) << store.out;
  auto bare = test::run_process({test::cohort_tool(), "bench"}, {}, 30);
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_NE(bare.err.find("usage: cohort bench <command>"), std::string::npos) << bare.err;
  auto wrong = test::run_process({test::cohort_tool(), "bench", "allreduse"}, {}, 30);
  EXPECT_EQ(wrong.exit_code, 2);
  EXPECT_EQ(wrong.err,
            "cohort bench: unknown command 'allreduse'; did you mean 'cohort bench allreduce'? (cohort bench --help "
            "lists its commands)\n");
}

// Started by hand, with no launcher's variables: one rank, as nccl-tests' all_reduce_perf runs alone.
TEST(BenchTool, AloneItRunsAsOneRank) {
  for (std::string op : {"allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "sendrecv"}) {
    // `env -u`: whatever runs the tests may itself be a rank of something.
    auto r = test::run_process({"env", "-u", "RANK", "-u", "WORLD_SIZE", "-u", "COHORT_RANK", "-u", "COHORT_WORLD_SIZE",
                                "-u", "OMPI_COMM_WORLD_RANK", "-u", "OMPI_COMM_WORLD_SIZE", "-u", "SLURM_PROCID", "-u",
                                "SLURM_NTASKS", "-u", "PMIX_RANK", "-u", "PMIX_NAMESPACE", test::cohort_tool(), "bench",
                                op, "-b", "64", "-e", "64K", "-f", "4", "-n", "2", "-w", "1", "--trials", "1", "-c"},
                               {}, 30);
    ASSERT_EQ(r.exit_code, 0) << op << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("# cohort bench " + op + ": 1 ranks,"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("# Out of bounds values : 0 OK"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(" 65536 "), std::string::npos) << op << ": the largest size has its row\n" << r.out;
  }
}

TEST(BenchTool, MemcpyPrintsBandwidth) {
  auto r = test::run_process({test::cohort_tool(), "bench", "memcpy", "-b", "1K", "-e", "64K", "--min-time", "0.01"},
                             {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("GB/s"), std::string::npos);
  EXPECT_NE(r.out.find("65536"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace cohort
