// The shared fork-a-rank helper (tests/support/fork_ranks.h) that the shm tests' process ranks use:
// a rank past the deadline is killed, reaped and named; exit codes, exceptions and a rank's stderr
// file are reported as they are. Before it, shm_small_test waited for its children without a deadline.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>

#include "support/fork_ranks.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

using std::chrono::milliseconds;

TEST(ForkRanks, ARankPastTheDeadlineIsKilledReapedAndNamed) {
  // The hung rank runs (its pid is in the file) until the deadline; then it is gone: no process, no zombie.
  TempDir dir;
  const std::string pid_file = dir.file("pid");
  auto pids = fork_ranks(1, [&](int) -> int {
    write_file(pid_file + ".tmp", std::to_string(::getpid()));
    ::rename((pid_file + ".tmp").c_str(), pid_file.c_str());  // whole, or not there
    ::sleep(5);  // hangs past the deadline (bounded: a broken helper leaves nothing behind for long)
    return 0;
  });
  ASSERT_EQ(pids.size(), 1u);
  const auto started = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (::access(pid_file.c_str(), F_OK) != 0) {
    ASSERT_LT(std::chrono::steady_clock::now(), started) << "rank 0 never ran";
    std::this_thread::sleep_for(milliseconds(2));
  }
  EXPECT_EQ(read_file(pid_file), std::to_string(pids[0]));
  EXPECT_EQ(describe_exit(wait_for_exit(pids[0], std::chrono::steady_clock::now() + milliseconds(100))),
            "still running at the deadline (killed)");
  EXPECT_EQ(::kill(pids[0], 0), -1);
  EXPECT_EQ(errno, ESRCH) << "rank 0 (pid " << pids[0] << ") was left behind";

  // The same through run_forked_ranks: the hung rank is named, and every child is reaped on return.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NONFATAL_FAILURE(run_forked_ranks(
                              2,
                              [](int r) -> int {
                                if (r == 0) return 0;
                                ::sleep(5);  // past the deadline
                                return 0;
                              },
                              milliseconds(300)),
                          "rank 1: still running at the deadline (killed)");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(::waitpid(-1, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD) << "a rank was left behind";
}

TEST(ForkRanks, ExitCodesAndExceptionsAreReportedPerRank) {
  EXPECT_NONFATAL_FAILURE(run_forked_ranks(3, [](int r) { return r == 1 ? 7 : 0; }, milliseconds(10000)),
                          "rank 1: exit 7");
  // One failure per call (EXPECT_NONFATAL_FAILURE counts them): the exception alone here.
  EXPECT_NONFATAL_FAILURE(run_forked_ranks(
                              3,
                              [](int r) -> int {
                                if (r == 2) throw std::runtime_error("rank two's mistake");
                                return 0;
                              },
                              milliseconds(10000)),
                          "rank 2: exit 99");
  run_forked_ranks(3, [](int) { return 0; }, milliseconds(10000));  // all zero: no failure
}

TEST(ForkRanks, ARanksStderrGoesToItsFile) {
  TempDir dir;
  auto pids = fork_ranks(
      2, [](int r) -> int { throw std::runtime_error("failed on purpose " + std::to_string(r)); },
      [&](int r) { return dir.file("err" + std::to_string(r)); });
  ASSERT_EQ(pids.size(), 2u);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (int r = 0; r < 2; ++r) {
    const int status = wait_for_exit(pids[size_t(r)], deadline);
    EXPECT_EQ(describe_exit(status), "exit 99") << "rank " << r;
    EXPECT_EQ(read_file(dir.file("err" + std::to_string(r))),
              "rank " + std::to_string(r) + ": failed on purpose " + std::to_string(r) + "\n");
  }
}

}  // namespace
}  // namespace cohort::test
