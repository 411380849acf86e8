#pragma once
// Ranks as forked processes, for tests whose ranks must not share an address space (shared memory
// across processes, a rank killed in the middle of a call): each child runs its rank's body and exits
// with its code; the parent waits for every child against a deadline, and kills and reaps what is left.

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace cohort::test {

// Forks `world` children, each running body(rank) and exiting with its return code, or 99 on an
// exception (printed on its stderr as "rank R: what"); a child never returns into the test framework.
// With `stderr_file`, rank r's stderr goes to the file stderr_file(r) (99 at once if it cannot be opened).
std::vector<pid_t> fork_ranks(int world, const std::function<int(int rank)>& body,
                              const std::function<std::string(int rank)>& stderr_file = {});

// Waits for `pid` until `deadline`; returns its raw wait status, or -1 when it had not ended by then
// (then it is killed and reaped).
int wait_for_exit(pid_t pid, std::chrono::steady_clock::time_point deadline);

// True for a wait_for_exit status of a normal exit with code 0.
bool exited_zero(int status);

// How a wait_for_exit status ended: "exit 3", "killed by signal 9", "still running at the deadline (killed)".
std::string describe_exit(int status);

// fork_ranks, then every rank must exit 0 within `limit` (one deadline for all of them); a test failure
// names each rank that did not, and how it ended. Every child is reaped before this returns.
void run_forked_ranks(int world, const std::function<int(int rank)>& body, std::chrono::milliseconds limit);

}  // namespace cohort::test
