#pragma once
// A child process with piped stdin/stdout/stderr and deadline-bounded reads, as `cohort doctor`
// needs it for its ssh sessions: start, read the first line, keep it running, end it, and never
// leave it behind (SIGKILL to its process group when a deadline passes or the object dies).

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "common/deadline.h"

namespace cohort::doctor {

class Child {
 public:
  // Starts argv (argv[0] looked up on PATH). Throws cohort::Error when fork/exec fails.
  explicit Child(const std::vector<std::string>& argv);
  ~Child();
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  // The next full line of stdout (without '\n'), or nullopt at EOF or when the deadline passes.
  std::optional<std::string> read_line(Deadline deadline);
  // Closes our end of its stdin: the remote side of an ssh session sees EOF.
  void close_stdin();
  // Waits until it exits, collecting output; SIGKILLs it when the deadline passes.
  // Returns the exit code (128+signal when killed by one).
  int wait(Deadline deadline);
  bool timed_out() const { return timed_out_; }
  // Output gathered so far (stdout after the lines already returned by read_line).
  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }
  // Last non-empty line of stderr (for one-line error messages), or "".
  std::string last_err_line() const;

 private:
  void pump(int timeout_ms);  // one poll round on stdout/stderr
  pid_t pid_ = -1;
  int in_ = -1, out_fd_ = -1, err_fd_ = -1;
  std::string out_, err_;
  bool exited_ = false, timed_out_ = false;
  int status_ = 0;
};

struct ChildResult {
  int exit_code = -1;
  bool timed_out = false;
  std::string out, err;
};
// Runs argv to completion (stdin closed at once), bounded by the deadline.
ChildResult run_child(const std::vector<std::string>& argv, Deadline deadline);

}  // namespace cohort::doctor
