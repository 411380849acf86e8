// Fault tests with real processes: comm_worker started N times sharing a file store; one rank is
// killed (SIGKILL), frozen (SIGSTOP) or calls something else, and the others must fail fast with a
// message that names the rank.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/test_support.h"

extern char** environ;

namespace cohort {
namespace {

using Clock = std::chrono::steady_clock;

struct Worker {
  pid_t pid = -1;
  std::string out, err;
  int status = -1;
  bool exited = false;
  Clock::time_point exit_time;
};

class Job {
 public:
  Job(const std::string& mode, int n, size_t bytes, std::vector<std::string> env = {}, bool from_env = false)
      : workers_(size_t(n)) {
    std::string store = from_env ? "env" : dir_.file("store");
    for (int r = 0; r < n; ++r) {
      Worker& w = workers_[size_t(r)];
      w.out = dir_.file("out" + std::to_string(r));
      w.err = dir_.file("err" + std::to_string(r));
      posix_spawn_file_actions_t fa;
      posix_spawn_file_actions_init(&fa);
      posix_spawn_file_actions_addopen(&fa, 1, w.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      posix_spawn_file_actions_addopen(&fa, 2, w.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      std::vector<std::string> args = {COHORT_COMM_WORKER, mode, store, std::to_string(r), std::to_string(n),
                                       std::to_string(bytes)};
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      std::vector<std::string> envs;
      for (char** e = environ; *e; ++e) envs.emplace_back(*e);
      for (auto& e : env) envs.push_back(e);
      if (from_env) {
        envs.push_back("RANK=" + std::to_string(r));
        envs.push_back("WORLD_SIZE=" + std::to_string(n));
      }
      std::vector<char*> envp;
      for (auto& e : envs) envp.push_back(e.data());
      envp.push_back(nullptr);
      int rc = posix_spawn(&w.pid, argv[0], &fa, nullptr, argv.data(), envp.data());
      posix_spawn_file_actions_destroy(&fa);
      if (rc != 0) throw std::runtime_error("posix_spawn comm_worker failed");
    }
  }
  ~Job() {
    for (auto& w : workers_) {
      if (!w.exited) {
        kill(w.pid, SIGKILL);
        kill(w.pid, SIGCONT);
        waitpid(w.pid, nullptr, 0);
      }
    }
  }
  Worker& operator[](int r) { return workers_[size_t(r)]; }
  // Waits until every worker printed `word` on stdout.
  bool wait_all_print(const std::string& word, double timeout_s) {
    auto end = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (Clock::now() < end) {
      bool all = true;
      for (auto& w : workers_) all = all && test::read_file(w.out).find(word) != std::string::npos;
      if (all) return true;
      reap();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  // Waits until every worker except `skip` exited (or the timeout passes).
  bool wait_exit(int skip, double timeout_s) {
    auto end = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (Clock::now() < end) {
      reap();
      bool all = true;
      for (size_t r = 0; r < workers_.size(); ++r)
        if (int(r) != skip && !workers_[r].exited) all = false;
      if (all) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }
  std::string err(int r) { return test::read_file(workers_[size_t(r)].err); }
  std::string out_path(int r) { return workers_[size_t(r)].out; }
  size_t size() const { return workers_.size(); }

 private:
  void reap() {
    for (auto& w : workers_) {
      if (w.exited) continue;
      int st = 0;
      if (waitpid(w.pid, &st, WNOHANG) == w.pid) {
        w.exited = true;
        w.status = st;
        w.exit_time = Clock::now();
      }
    }
  }
  test::TempDir dir_;
  std::vector<Worker> workers_;
};

std::set<std::string> dev_shm_entries() {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) out.insert(e.path().filename().string());
  return out;
}

// SIGKILL of rank 1 during allreduces: the others fail within 2 s naming it, and /dev/shm holds
// nothing new. `env` picks the path: default (shm::Group collectives), the shm point-to-point
// transport alone (COHORT_SHM_COLLECTIVES=0: coll:: algorithms over it), or TCP alone.
void killed_peer_fails_the_others(std::vector<std::string> env) {
  const auto before = dev_shm_entries();
  const int n = 3;
  env.push_back("COHORT_TIMEOUT=60");
  Job job("loop", n, 1 << 20, env);
  ASSERT_TRUE(job.wait_all_print("ready", 30)) << job.err(0);
  auto killed_at = Clock::now();
  kill(job[1].pid, SIGKILL);
  ASSERT_TRUE(job.wait_exit(1, 10)) << "ranks still running 10 s after rank 1 was killed";
  for (int r : {0, 2}) {
    double s = std::chrono::duration<double>(job[r].exit_time - killed_at).count();
    EXPECT_LT(s, 2.0) << "rank " << r << " took " << s << " s to fail";
    EXPECT_TRUE(WIFEXITED(job[r].status) && WEXITSTATUS(job[r].status) == 3) << job.err(r);
    std::string e = job.err(r);
    EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
    // Either it saw rank 1 die itself (PeerLostError) or a neighbour's failure cut it off; the
    // message must name the lost rank in both cases.
    EXPECT_TRUE(e.find("PeerLostError") != std::string::npos) << e;
  }
  for (const auto& name : dev_shm_entries()) EXPECT_TRUE(before.count(name)) << "/dev/shm/" << name << " was left behind";
}

TEST(Faults, KilledPeerFailsEveryOtherRankWithinTwoSeconds) { killed_peer_fails_the_others({}); }
TEST(Faults, KilledPeerOverTheShmTransportFailsTheOthersWithinTwoSeconds) {
  killed_peer_fails_the_others({"COHORT_TRANSPORT=shm", "COHORT_SHM_COLLECTIVES=0"});
}
TEST(Faults, KilledPeerOverTcpFailsTheOthersWithinTwoSeconds) { killed_peer_fails_the_others({"COHORT_TRANSPORT=tcp"}); }

TEST(Faults, FrozenPeerHitsTheDeadlineNamingIt) {
  const int n = 3;
  Job job("loop", n, 4096, {"COHORT_TIMEOUT=3", "COHORT_SLOW_WARNING=1"});
  ASSERT_TRUE(job.wait_all_print("ready", 30)) << job.err(0);
  auto frozen_at = Clock::now();
  kill(job[2].pid, SIGSTOP);
  ASSERT_TRUE(job.wait_exit(2, 15)) << "ranks still running 15 s after rank 2 was frozen";
  kill(job[2].pid, SIGCONT);
  for (int r : {0, 1}) {
    double s = std::chrono::duration<double>(job[r].exit_time - frozen_at).count();
    EXPECT_LT(s, 8.0) << "rank " << r;
    std::string e = job.err(r);
    EXPECT_NE(e.find("TimeoutError"), std::string::npos) << e;
    EXPECT_NE(e.find("has waited"), std::string::npos) << "no slow-rank warning before the deadline: " << e;
  }
  // At least one survivor waited on rank 2 directly and names it.
  std::string both = job.err(0) + job.err(1);
  EXPECT_NE(both.find("rank 2"), std::string::npos) << both;
}

TEST(Faults, MismatchedCountsAreReportedNotCorrupted) {
  Job job("mismatch", 2, 4096);
  ASSERT_TRUE(job.wait_exit(-1, 30));
  for (int r : {0, 1}) {
    std::string e = job.err(r);
    EXPECT_TRUE(WIFEXITED(job[r].status) && WEXITSTATUS(job[r].status) == 3) << e;
    EXPECT_NE(e.find("MismatchError"), std::string::npos) << e;
    EXPECT_NE(e.find("allreduce(count="), std::string::npos) << e;
  }
}

// A mismatched last call that returned on every rank (a small broadcast's root does not wait for its
// receivers) is still named: when the communicator ends, by every rank.
TEST(Faults, TwoRanksThatBothBroadcastAsTheRootAndEndNameTheMismatch) {
  Job job("two-roots", 2, 64);
  ASSERT_TRUE(job.wait_exit(-1, 30));
  for (int r : {0, 1}) {
    std::string e = job.err(r);
    EXPECT_NE(test::read_file(job.out_path(r)).find("broadcast returned"), std::string::npos) << e;
    EXPECT_NE(e.find("ending: "), std::string::npos) << e;
    EXPECT_NE(e.find("broadcast(count=4, float, root=" + std::to_string(1 - r) + ")"), std::string::npos) << e;
  }
}

TEST(FromEnv, TorchrunVariablesRankZeroHostsTheStore) {
  const int n = 3;
  int port = test::free_port();
  Job job("once", n, 64, {"MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port), "COHORT_TIMEOUT=30"},
          /*from_env=*/true);
  ASSERT_TRUE(job.wait_exit(-1, 40));
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(WIFEXITED(job[r].status) && WEXITSTATUS(job[r].status) == 0) << job.err(r);
    EXPECT_NE(test::read_file(job.out_path(r)).find("sum 3"), std::string::npos) << job.err(r);
  }
}

}  // namespace
}  // namespace cohort
