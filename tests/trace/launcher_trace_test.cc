// The flight recorder, stall inspector, live stats and timeline through `cohort run`, with real
// processes: comm_worker ranks (tests/comm/comm_worker.cc) that skip an operation, stop themselves,
// call with a different size, or just work.
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/cohort_run.h"
#include "support/test_support.h"
#include "trace/dump.h"

namespace cohort::test {
namespace {

TEST(LauncherTrace, ASkippedAllreduceNamesTheRankAndTheSequenceNumber) {
  TempDir dir;
  auto r = run_process(run_workers(3, "skip", {"--trace-dir", dir.path()}), {"COHORT_TIMEOUT=20"}, 60);
  EXPECT_NE(r.exit_code, 0) << r.err;
  // Rank 1 did 9 allreduces and left; ranks 0 and 2 were in their 10th.
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex(R"(flight recorder: rank 1 stopped first, at #9 allreduce\(count=1024, float, sum\) \(4\.0 KiB\) \(rank 1: done, process exited with code 0\); ranks 0,2 waited for it in #10 allreduce)")))
      << r.err;
  EXPECT_NE(r.err.find("flight recorder: dumps of every rank in " + dir.path()), std::string::npos) << r.err;
  // The dumps say the same offline.
  auto show = run_process({cohort_tool(), "trace", "show", dir.path()}, {}, 30);
  EXPECT_EQ(show.exit_code, 0) << show.err;
  EXPECT_NE(show.out.find("rank 1 stopped first, at #9 allreduce"), std::string::npos) << show.out;
  auto dumps = trace::read_dump_dir(dir.path());
  ASSERT_EQ(dumps.size(), 3u);
  EXPECT_EQ(dumps[1].entries.back().seq, 9u);
}

TEST(LauncherTrace, AStoppedRankGetsOneStallWarningAndTheJobEndsAtItsDeadlineWithDumps) {
  TempDir dir;
  auto r = run_process(run_workers(3, "stop", {"--trace-dir", dir.path()}),
                       {"COHORT_STALL_WARN_S=1", "COHORT_TIMEOUT=4", "COHORT_SLOW_WARNING=30"}, 60);
  EXPECT_NE(r.exit_code, 0) << r.err;
  std::regex warning(R"(warning: stall: ranks 0,2 entered #7 allreduce\S* .* ago; rank 1 not: rank 1 last #6 allreduce.* done, process stopped \(SIGSTOP\))");
  EXPECT_TRUE(std::regex_search(r.err, warning)) << r.err;
  // Once, not every second.
  size_t first = r.err.find("warning: stall:");
  EXPECT_EQ(r.err.find("warning: stall:", first + 1), std::string::npos) << r.err;
  // The deadline (4 s), not the stall warning, ended it; the dumps are there.
  EXPECT_GE(r.seconds, 4.0);
  EXPECT_LT(r.seconds, 20.0);
  EXPECT_NE(r.err.find("timed out"), std::string::npos) << r.err;
  EXPECT_EQ(trace::read_dump_dir(dir.path()).size(), 3u);
}

// Two per-node launchers on loopback, one rank each. Rank 1 (node 1) stops itself after its 6th
// allreduce; 2.5 s later (node 1 has published that, once a second) node 1's launcher is frozen too
// (SIGSTOP), so node 1 publishes no more snapshots.
// The head (node 0) warns once, for the whole job: its rank 0 waits in #7, and rank 1 is named as
// silent since its node's last snapshot, not as if that snapshot were current. Node 1 warns about
// nothing itself. Then node 1 is continued and its rank killed, which ends the job.
TEST(LauncherTrace, TheHeadWarnsForEveryNodeAndNamesASilentNodesRanksAsSilent) {
  TempDir dir;
  std::string d = dir.path();
  int port = free_port();
  std::string node = "'" + cohort_tool() + "' run --nnodes 2 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port " +
                     std::to_string(port) + " --join-timeout 20 --kill-grace 1 --trace-dir " + d + "/trace --node-rank ";
  std::string worker = " /bin/sh -c 'echo $$ > " + d + "/pid.$RANK; exec " + COHORT_COMM_WORKER + " stop env 0 0'";
  std::string script =
      node + "0" + worker + " 2> " + d + "/node0.err & head=$!; " + node + "1" + worker + " 2> " + d +
      "/node1.err & other=$!; "
      // rank 1 stopped (state T), then its launcher
      "i=0; until [ -s " + d + "/pid.1 ] && grep -q ') T ' /proc/$(cat " + d + "/pid.1)/stat 2>/dev/null; do "
      "sleep 0.02; i=$((i+1)); [ $i -lt 1500 ] || break; done; sleep 2.5; kill -STOP $other; "
      "i=0; until grep -q 'warning: stall' " + d + "/node0.err; do sleep 0.1; i=$((i+1)); [ $i -lt 300 ] || break; "
      "done; kill -CONT $other; kill -9 $(cat " + d + "/pid.1); wait $head; wait $other";
  auto r = run_process({"/bin/sh", "-c", script},
                       {"COHORT_STALL_WARN_S=10", "COHORT_TIMEOUT=60", "COHORT_SLOW_WARNING=60"}, 90);
  std::string head = read_file(dir.file("node0.err")), other = read_file(dir.file("node1.err"));
  std::regex warning(R"(warning: stall: rank 0 entered #7 allreduce\S* .* ago; rank 1 silent \(no flight recorder news from their node\): rank 1 since [0-9.]+ s ago, last seen in #6 allreduce\(count=1024, float, sum\) \(4\.0 KiB\) done, process stopped \(SIGSTOP\))");
  EXPECT_TRUE(std::regex_search(head, warning)) << head;
  size_t first = head.find("warning: stall:");
  EXPECT_EQ(head.find("warning: stall:", first + 1), std::string::npos) << head;  // once
  EXPECT_EQ(other.find("warning: stall"), std::string::npos) << other;           // by the head only
  for (int rank = 0; rank < 2; ++rank) {
    std::string pid = read_file(dir.file("pid." + std::to_string(rank)));
    if (!pid.empty() && process_alive(std::stoi(pid))) kill(std::stoi(pid), SIGKILL);
  }
}

TEST(LauncherTrace, ASizeMismatchIsNamedWithBothSides) {
  TempDir dir;
  auto r = run_process(run_workers(3, "mismatch", {"--trace-dir", dir.path()}), {"COHORT_TIMEOUT=20"}, 60);
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex(R"(flight recorder: mismatch at operation #1: rank \d called #1 allreduce\(count=(1024|512), .* but rank \d called #1 allreduce\(count=(512|1024))")))
      << r.err;
}

TEST(LauncherTrace, TimelineOfEveryRankMergedIntoOneChromeTrace) {
  TempDir dir;
  std::string path = dir.file("trace.json");
  auto r = run_process(run_workers(2, "skip", {"--timeline", path, "--trace-dir", dir.file("tmp")}), {}, 60);
  // (mode skip fails the job; the ranks that ended normally still wrote their timelines)
  std::ifstream in(path);
  ASSERT_TRUE(in) << r.err;
  auto trace = nlohmann::json::parse(in);
  std::set<int> ranks;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X") ranks.insert(e["pid"].get<int>());
  EXPECT_TRUE(ranks.count(1)) << r.err;  // rank 1 exited normally
  EXPECT_NE(r.err.find("timeline of"), std::string::npos) << r.err;
}

TEST(LauncherTrace, LiveStatsAreJsonLinesWhenNotATerminal) {
  auto r = run_process(run_workers(2, "timed", {"--stats"}), {}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::regex line(R"(\{"cohort_stats":\{[^\n]*"ops_per_s":([0-9.e+]+)[^\n]*"rank":0)");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, line)) << r.err;
  EXPECT_GT(std::stod(m[1]), 0.0) << m[0];
}

// The flight recorder's ring is memory the worker writes; a worker whose memory is corrupt (when the
// recorder matters most) may write anything there, its header included: a capacity of 0 (a division by
// zero in the launcher) or far past the ring (reads out of bounds), a rank, world and host of its
// choosing, entries of no known operation. The launcher reads the ring with the size and identity it
// created it with and leaves out what cannot be an operation: the job ends with the workers' exit code,
// and rank 0's dump names rank 0 of 2 on this host.
TEST(LauncherTrace, AWorkerThatCorruptsItsRingCannotCrashOrMisleadTheLauncher) {
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  for (const std::string how : {"zero", "huge"}) {
    TempDir dir;
    auto r = run_process(run_workers(2, "corrupt-ring:" + how, {"--trace-dir", dir.path()}), {"COHORT_TIMEOUT=20"}, 60);
    EXPECT_EQ(r.exit_code, 3) << how << "\n" << r.err;
    EXPECT_NE(r.out.find("rank 0 corrupted its ring"), std::string::npos) << how << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("dumps of every rank in " + dir.path()), std::string::npos) << how << "\n" << r.err;
    auto dumps = trace::read_dump_dir(dir.path());
    ASSERT_EQ(dumps.size(), 2u) << how << "\n" << r.err;
    EXPECT_EQ(dumps[0].rank, 0) << how;
    EXPECT_EQ(dumps[0].world, 2) << how;
    EXPECT_EQ(dumps[0].host, std::string(host)) << how;
    EXPECT_GE(dumps[0].pid, 0) << how;
    for (const auto& e : dumps[0].entries)
      EXPECT_EQ(e.kind, coll::OpKind::kAllreduce) << how << ": " << trace::describe(e);
    ASSERT_FALSE(dumps[1].entries.empty()) << how;
    EXPECT_EQ(dumps[1].entries.back().seq, 3u) << how << ": rank 1's ring is intact";
  }
}

}  // namespace
}  // namespace cohort::test
