// A rank whose process ends while the others wait for it (to join, or inside a collective), with
// real processes through `cohort run`: comm_worker ranks (comm_worker.cc, modes exit-early,
// exit-between, late-join). The launcher publishes the end in the job's store (comm/peer_exits.h), so
// the waiting ranks fail within a second or two naming the rank, how it ended and the operation, and
// the launcher's summary names it as the root cause.
#include <signal.h>

#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "comm/peer_exits.h"
#include "support/cohort_run.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

// Runs a 2-rank job in `mode`; the communicators' deadline is far beyond what the test waits for.
ProcessResult run_two(const std::string& mode, std::vector<std::string> env = {}) {
  env.push_back("COHORT_TIMEOUT=120");
  return run_process(run_workers(2, mode), env, 60);
}

bool has(const std::string& text, const std::string& regex) { return std::regex_search(text, std::regex(regex)); }

// The record as the launcher makes it from a wait status and a flight recorder, and how a rank words it.
TEST(PeerExits, WhereARankStoppedComesFromItsFlightRecorder) {
  trace::RankSnapshot ring;
  ring.started = true;
  auto op = [](uint32_t comm, uint32_t seq, trace::OpState state) {
    trace::OpRecord r;
    r.comm = comm;
    r.seq = seq;
    r.state = state;
    return r;
  };
  ring.entries = {op(7, 3, trace::OpState::kDone), op(9, 1, trace::OpState::kRunning), op(7, 4, trace::OpState::kDone),
                  op(7, 0, trace::OpState::kDone)};  // the last: point-to-point (no number)
  ring.total = ring.entries.size();
  auto r = comm::exit_record_from_json(comm::to_json(comm::make_exit_record(1, "h", 42, 0, 1.5, &ring)));
  EXPECT_EQ(comm::exit_text(r), "exited (code 0)");
  EXPECT_EQ(comm::exit_point(r, 7, 5), "before operation #5");
  EXPECT_EQ(comm::exit_point(r, 9, 1), "during operation #1");
  EXPECT_EQ(comm::exit_point(r, 11, 1), "before operation #1");  // the ring is whole: it never ran one there
  ring.total = 5000;                                              // wrapped: older operations are gone
  r = comm::make_exit_record(1, "h", 42, SIGKILL, 1.5, &ring);
  EXPECT_EQ(comm::exit_text(r), "exited (killed by SIGKILL)");
  EXPECT_EQ(comm::exit_point(r, 11, 3), "before or during operation #3");
  r = comm::make_exit_record(1, "h", 42, 3 << 8, 1.5, nullptr);  // exit code 3, no flight recorder
  EXPECT_EQ(comm::exit_text(r), "exited (code 3)");
  EXPECT_EQ(comm::exit_point(r, 7, 5), "before or during operation #5");
}

// Before its communicator exists: rank 0's join fails at once with the line, the job with rank 1.
TEST(Exits, ARankThatExitsWithCodeZeroBeforeJoiningFailsTheJoinWithinTwoSeconds) {
  auto r = run_two("exit-early:0");
  EXPECT_EQ(r.exit_code, 3) << r.err;  // rank 0's code: an exit with code 0 fails nothing by itself
  EXPECT_LT(r.seconds, 5.0) << r.err;
  EXPECT_TRUE(has(r.err, R"(ERROR PeerLostError: rank 1 exited \(code 0\) before joining communicator )")) << r.err;
  EXPECT_TRUE(has(r.err, R"(job failed \(exit 3\): rank 1 on \S+ \(pid \d+\) exited with code 0 after [0-9.]+ s while the other ranks still needed it; then rank 0 )"))
      << r.err;
}

TEST(Exits, ARankThatExitsWithCodeThreeBeforeJoiningIsNamedByTheJoinAndTheSummary) {
  auto r = run_two("exit-early:3");
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_LT(r.seconds, 5.0) << r.err;
  // Rank 0 says so itself, within the launcher's report window (before its stop signal).
  EXPECT_TRUE(has(r.err, R"(ERROR PeerLostError: rank 1 exited \(code 3\) before joining communicator )")) << r.err;
  EXPECT_TRUE(has(r.err, R"(job failed \(exit 3\): rank 1 on \S+ \(pid \d+\) exited with code 3)")) << r.err;
}

TEST(Exits, AKilledRankBeforeJoiningIsNamedByTheJoinAndTheSummary) {
  auto r = run_two("exit-early:kill");
  EXPECT_EQ(r.exit_code, 128 + 9) << r.err;
  EXPECT_LT(r.seconds, 5.0) << r.err;
  EXPECT_TRUE(has(r.err, R"(ERROR PeerLostError: rank 1 exited \(killed by SIGKILL\) before joining communicator )"))
      << r.err;
  EXPECT_TRUE(has(r.err, R"(job failed \(exit 137\): rank 1 on \S+ \(pid \d+\) was killed by SIGKILL)")) << r.err;
}

// Between two collectives: rank 1 returns from main after allreduce #3 (its communicator says
// goodbye), rank 0 is in #4. `env` picks the path (shm group by default, TCP).
void exit_between_collectives_is_named(std::vector<std::string> env) {
  auto r = run_two("exit-between:0", env);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_LT(r.seconds, 5.0) << r.err;
  EXPECT_TRUE(has(r.err, R"(ERROR PeerLostError: allreduce #4 \(4\.0 KiB\) on rank 0 \(\S+\): rank 1 exited \(code 0\) before operation #4: )"))
      << r.err;
  // After which operation, and what the other waited in (their flight recorders).
  EXPECT_TRUE(has(r.err, R"(job failed \(exit 3\): rank 1 on \S+ \(pid \d+\) exited with code 0 after allreduce #3 while rank 0 waited for it in allreduce #4; then rank 0 )"))
      << r.err;
}

TEST(Exits, ARankThatExitsWithCodeZeroBetweenCollectivesIsNamedOverSharedMemory) {
  exit_between_collectives_is_named({});
}
TEST(Exits, ARankThatExitsWithCodeZeroBetweenCollectivesIsNamedOverTcp) {
  exit_between_collectives_is_named({"COHORT_TRANSPORT=tcp"});
}

TEST(Exits, AKilledRankBetweenCollectivesIsNamedWithItsSignalAndTheOperation) {
  auto r = run_two("exit-between:kill");
  EXPECT_EQ(r.exit_code, 128 + 9) << r.err;
  EXPECT_LT(r.seconds, 5.0) << r.err;
  EXPECT_TRUE(has(r.err, R"(rank 1 exited \(killed by SIGKILL\) before operation #4: )")) << r.err;
  EXPECT_TRUE(has(r.err, R"(job failed \(exit 137\): rank 1 on \S+ \(pid \d+\) was killed by SIGKILL)")) << r.err;
}

// A communicator made later (a subgroup, whose keys the launcher does not know): the join reads the
// launcher's count of exits about once a second.
TEST(Exits, ARankThatExitsBeforeASubgroupIsBuiltIsNamedByItsJoin) {
  auto r = run_two("exit-before-subgroup:0");
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_LT(r.seconds, 5.0) << r.err;
  EXPECT_TRUE(has(r.err, R"(ERROR PeerLostError: rank 1 exited \(code 0\) before joining communicator '\S+/sub)")) << r.err;
  EXPECT_TRUE(has(r.err, R"(job failed \(exit 3\): rank 1 on \S+ \(pid \d+\) exited with code 0 )")) << r.err;
}

// Two nodes (per-node mode on loopback): rank 1 runs on node 1, whose launcher publishes its end in node
// 0's store; rank 0 names it, and node 0's summary finds the record there.
TEST(Exits, AnExitOnAnotherNodeIsNamedByTheJoinAndTheSummary) {
  const int port = free_port();
  auto node = [&](int rank) {
    return run_process({cohort_tool(), "run", "--nnodes", "2", "--node-rank", std::to_string(rank), "--master-addr",
                        "127.0.0.1", "--master-port", std::to_string(port), "--nproc-per-node", "1", "--join-timeout",
                        "20", COHORT_COMM_WORKER, "exit-early:0", "env", "0", "0"},
                       {"COHORT_TIMEOUT=120"}, 60);
  };
  ProcessResult second;
  std::thread t([&] { second = node(1); });
  auto first = node(0);
  t.join();
  EXPECT_EQ(first.exit_code, 3) << first.err;
  EXPECT_EQ(second.exit_code, 3) << second.err;
  EXPECT_LT(first.seconds, 10.0) << first.err;
  EXPECT_TRUE(has(first.err, R"(ERROR PeerLostError: rank 1 exited \(code 0\) before joining communicator )")) << first.err;
  EXPECT_TRUE(has(first.err, R"(job failed \(exit 3\): rank 1 on \S+ \(pid \d+\) exited with code 0 after [0-9.]+ s while the other ranks still needed it; then rank 0 )"))
      << first.err;
}

// The join's "N of M ranks joined" warning comes after COHORT_SLOW_WARNING, then at a doubling
// interval (docs/errors.md): with 0.2 s and a rank that joins after 2.5 s, at 0.2, 0.6 and 1.4 s (the
// next would be at 3.0 s); at a fixed interval it would come about 12 times.
TEST(Exits, JoinWarningsComeAtADoublingInterval) {
  auto r = run_process(run_workers(2, "late-join:2500"), {"COHORT_SLOW_WARNING=0.2", "COHORT_TIMEOUT=60"}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::regex warning(R"(1 of 2 ranks joined after [0-9.]+ s; missing rank\(s\) 1)");
  const auto warnings = std::distance(std::sregex_iterator(r.err.begin(), r.err.end(), warning), std::sregex_iterator());
  EXPECT_GE(warnings, 2) << r.err;
  EXPECT_LE(warnings, 4) << r.err;
}

}  // namespace
}  // namespace cohort::test
