// Hierarchical allreduce across simulated hosts: 4 processes, COHORT_HOST_ID=a for ranks 0,1 and =b for
// ranks 2,3 (distinct host identities on one machine), sharing a file store. Each worker checks it took
// the hierarchical path and that its results are right.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "support/test_support.h"

extern char** environ;

namespace cohort {
namespace {

TEST(ShmHierarchical, TwoSimulatedHostsOfTwoRanks) {
  test::TempDir dir;
  const std::string store = dir.file("store");
  const int world = 4;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e)
      if (std::string(*e).rfind("COHORT_HOST_ID=", 0) != 0 && std::string(*e).rfind("COHORT_TRANSPORT=", 0) != 0 &&
          std::string(*e).rfind("COHORT_SHM_COLLECTIVES=", 0) != 0)
        env.emplace_back(*e);
    env.push_back(std::string("COHORT_HOST_ID=") + (r < 2 ? "hostA" : "hostB"));
    env.push_back("COHORT_SHM_COLLECTIVES=1");
    env.push_back("COHORT_HIERARCHICAL=1");  // off by default (docs/algorithms-shm.md)
    std::vector<std::string> args = {SHM_HIER_WORKER, store, std::to_string(r), std::to_string(world)};
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
    ASSERT_EQ(0, posix_spawn(&pid, SHM_HIER_WORKER, &fa, nullptr, argv.data(), envp.data()));
    posix_spawn_file_actions_destroy(&fa);
    pids.push_back(pid);
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  for (int r = 0; r < world; ++r) {
    int status = 0;
    while (::waitpid(pids[r], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > end) {
        for (pid_t p : pids) ::kill(p, SIGKILL);
        ::waitpid(pids[r], &status, 0);
        FAIL() << "rank " << r << " did not finish within 90 s: " << test::read_file(dir.file("out" + std::to_string(r)));
      }
      ::usleep(10000);
    }
    const std::string out = test::read_file(dir.file("out" + std::to_string(r)));
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r << ": " << out;
    EXPECT_NE(out.find("ok"), std::string::npos) << "rank " << r << ": " << out;
  }
}

}  // namespace
}  // namespace cohort
