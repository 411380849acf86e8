// Hierarchical allreduce across simulated hosts: each worker process gets COHORT_HOST_ID of its
// simulated host (distinct host identities on one machine) and they share a file store. The worker
// (shm_hier_worker.cc) checks which path the communicator chose and that the results are right, or,
// in "kill" mode, that the survivors of a SIGKILLed rank fail quickly naming it.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <string>
#include <vector>

#include "support/test_support.h"

extern char** environ;

namespace cohort {
namespace {

struct Rank {
  int status = 0;
  std::string out;
};

// Starts `hosts` x `per_host` workers (rank r on host r / per_host) with `extra` environment and
// worker arguments `mode...`, waits for all of them (bounded) and returns their exit status and output.
std::vector<Rank> run_job(test::TempDir& dir, int hosts, int per_host, const std::vector<std::string>& extra,
                          const std::vector<std::string>& mode) {
  const std::string store = dir.file("store");
  const int world = hosts * per_host;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string v(*e);
      if (v.rfind("COHORT_HOST_ID=", 0) != 0 && v.rfind("COHORT_TRANSPORT=", 0) != 0 &&
          v.rfind("COHORT_SHM_COLLECTIVES=", 0) != 0 && v.rfind("COHORT_HIERARCHICAL=", 0) != 0)
        env.push_back(v);
    }
    env.push_back("COHORT_HOST_ID=host" + std::string(1, char('A' + r / per_host)));
    for (const auto& e : extra) env.push_back(e);
    std::vector<std::string> args = {SHM_HIER_WORKER, store, std::to_string(r), std::to_string(world)};
    args.insert(args.end(), mode.begin(), mode.end());
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    const std::string out = dir.file("out" + std::to_string(r));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = -1;
    EXPECT_EQ(0, posix_spawn(&pid, SHM_HIER_WORKER, &fa, nullptr, argv.data(), envp.data()));
    posix_spawn_file_actions_destroy(&fa);
    pids.push_back(pid);
  }
  std::vector<Rank> ranks(static_cast<size_t>(world));
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  for (int r = 0; r < world; ++r) {
    int status = 0;
    while (::waitpid(pids[r], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > end) {
        for (pid_t p : pids) ::kill(p, SIGKILL);
        ::waitpid(pids[r], &status, 0);
        ADD_FAILURE() << "rank " << r << " did not finish within 90 s";
        break;
      }
      ::usleep(10000);
    }
    ranks[r] = {status, test::read_file(dir.file("out" + std::to_string(r)))};
  }
  return ranks;
}

void expect_all_ok(const std::vector<Rank>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_TRUE(WIFEXITED(ranks[r].status) && WEXITSTATUS(ranks[r].status) == 0) << "rank " << r << ": " << ranks[r].out;
    EXPECT_NE(ranks[r].out.find("ok"), std::string::npos) << "rank " << r << ": " << ranks[r].out;
  }
}

TEST(ShmHierarchical, ChosenByDefaultForTwoHostsOfTwoRanks) {
  test::TempDir dir;
  expect_all_ok(run_job(dir, 2, 2, {}, {"expect-hierarchical"}));
}

TEST(ShmHierarchical, TwoHostsOfThreeAndFourHostsOfTwo) {
  {
    test::TempDir dir;
    expect_all_ok(run_job(dir, 2, 3, {"COHORT_HIERARCHICAL=1"}, {"expect-hierarchical"}));
  }
  {
    test::TempDir dir;
    expect_all_ok(run_job(dir, 4, 2, {}, {"expect-hierarchical"}));
  }
}

TEST(ShmHierarchical, OffOrImpossibleLayoutsUseTheFlatAlgorithmsWithTheSameResults) {
  {
    test::TempDir dir;  // switched off
    expect_all_ok(run_job(dir, 2, 2, {"COHORT_HIERARCHICAL=0"}, {"expect-flat"}));
  }
  {
    test::TempDir dir;  // one rank per host: nothing to combine inside a host
    expect_all_ok(run_job(dir, 3, 1, {}, {"expect-flat"}));
  }
}

TEST(ShmHierarchical, ForcedOnAnImpossibleLayoutIsAConfigError) {
  test::TempDir dir;
  auto ranks = run_job(dir, 3, 1, {"COHORT_HIERARCHICAL=1"}, {"expect-hierarchical"});
  for (size_t r = 0; r < ranks.size(); ++r)
    EXPECT_NE(ranks[r].out.find("COHORT_HIERARCHICAL=1 needs several hosts"), std::string::npos)
        << "rank " << r << ": " << ranks[r].out;
}

TEST(ShmHierarchical, SigkillOfARankFailsTheOthersWithin2sNamingTheWorldRank) {
  // World rank 3 is local rank 1 on hostB: its host neighbour (rank 2) loses it over shared memory,
  // its cross-host ring partner (rank 1, ring rank 0 of ring "local 1") over TCP; rank 0 hears of it
  // from rank 1. Every survivor must fail within 2 s, and the ones that saw the death name world
  // rank 3 and its host (not ring rank 1).
  test::TempDir dir;
  auto ranks = run_job(dir, 2, 2, {"COHORT_TIMEOUT=30"}, {"kill", "3", dir.file("died_at")});
  EXPECT_TRUE(WIFSIGNALED(ranks[3].status) && WTERMSIG(ranks[3].status) == SIGKILL) << ranks[3].out;
  for (int r : {0, 1, 2}) {
    const std::string& out = ranks[size_t(r)].out;
    EXPECT_TRUE(WIFEXITED(ranks[r].status) && WEXITSTATUS(ranks[r].status) == 0) << "rank " << r << ": " << out;
    const auto at = out.find("RAISED ");
    ASSERT_NE(at, std::string::npos) << "rank " << r << ": " << out;
    const double seconds = std::stod(out.substr(at + 7));
    EXPECT_LT(seconds, 2.0) << "rank " << r << ": " << out;
  }
  // Host names are "<hostname>+hostB" under COHORT_HOST_ID. Rank 0 hears of it second-hand, from
  // rank 1 (its host neighbour) or rank 2 (its ring partner, whose host-side failure is passed on
  // through the ring instead of looking like an orderly exit): it names rank 3 too.
  const std::regex names_rank3(R"(rank 3 \([^)]*hostB\))");
  for (int r : {0, 1, 2}) {
    EXPECT_TRUE(std::regex_search(ranks[size_t(r)].out, names_rank3)) << "rank " << r << ": " << ranks[r].out;
    EXPECT_EQ(ranks[size_t(r)].out.find("destroyed its communicator"), std::string::npos)
        << "rank " << r << ": " << ranks[r].out;
  }
}

}  // namespace
}  // namespace cohort
