// Ranks as forked processes (fork_ranks.h).
#include "support/fork_ranks.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <thread>

#include <gtest/gtest.h>

namespace cohort::test {

std::vector<pid_t> fork_ranks(int world, const std::function<int(int rank)>& body,
                              const std::function<std::string(int rank)>& stderr_file) {
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const std::string err = stderr_file ? stderr_file(r) : std::string();
    const pid_t pid = ::fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork of rank " << r << " failed";
      break;
    }
    if (pid == 0) {
      int code = 99;
      if (err.empty() || std::freopen(err.c_str(), "w", stderr) != nullptr) {
        try {
          code = body(r);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        }
      }
      std::fflush(stderr);
      ::_exit(code);  // not exit(): the parent's atexit handlers and gtest's state stay the parent's
    }
    pids.push_back(pid);
  }
  return pids;
}

int wait_for_exit(pid_t pid, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    int status = 0;
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid) return status;
    if (got < 0) return -1;  // not our child, or reaped already: nothing to wait for
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

bool exited_zero(int status) { return status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0; }

std::string describe_exit(int status) {
  if (status == -1) return "still running at the deadline (killed)";
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "wait status " + std::to_string(status);
}

void run_forked_ranks(int world, const std::function<int(int rank)>& body, std::chrono::milliseconds limit) {
  const std::vector<pid_t> pids = fork_ranks(world, body);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (size_t r = 0; r < pids.size(); ++r) {
    const int status = wait_for_exit(pids[r], deadline);
    EXPECT_TRUE(exited_zero(status)) << "rank " << r << ": " << describe_exit(status) << " (within "
                                     << limit.count() << " ms; its stderr is above)";
  }
}

}  // namespace cohort::test
