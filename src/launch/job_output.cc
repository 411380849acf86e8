// Output: draining the workers' and agents' pipes into their sinks (launch/output.h: tags, per-rank
// files, the stderr tail), and the one-screen failure summary built from a worker's last stderr lines.
#include <errno.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/core.h>

#include "common/socket.h"
#include "launch/job_internal.h"

namespace cohort::launch::job_detail {

void Job::drain(int fd, OutputSink& sink, bool is_stderr, UniqueFd& holder) {
  drain_output(fd, sink, is_stderr, holder, supervisor());
}

void drain_output(int fd, OutputSink& sink, bool is_stderr, UniqueFd& holder, Supervisor& loop) {
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      sink.on_data(is_stderr, buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    // EOF or error: this stream is finished.
    sink.on_eof(is_stderr);
    loop.unwatch(fd);
    holder.reset();
    return;
  }
}

std::string Job::failure_summary(const Worker& w) {
  double secs = std::chrono::duration<double>(w.ended - w.started).count();
  std::string s = fmt::format("{} on {} (pid {}) {} after {:.2f} s", plan_.process_name(w.rank), plan_.node(plan_.this_node)->host,
                              w.pid, describe_worker_exit(w), secs);
  if (plan_.ray.enabled && !plan_.is_ray_driver(w.rank))
    s += fmt::format(": {}'s Ray node is gone (its `ray start --block` runs for as long as the job)",
                     plan_.node(plan_.this_node)->host);
  auto tail = w.sink->stderr_tail();
  if (tail.empty()) {
    s += "; it wrote nothing to stderr";
  } else {
    s += plan_.merge_stderr ? "; last lines of its output (stderr merged):" : "; last lines of its stderr:";
    for (const auto& l : tail) s += "\n    | " + l;
  }
  return s + missing_module_hint(tail) + usage_exit_hint(w);
}

std::string Job::usage_exit_hint(const Worker& w) const {
  // Exit code 2 is what a program's command-line parser (Python's argparse, CLI11, getopt users) returns
  // for a bad argument, and also what cohort run returns for its own bad input: say which one this is.
  if (!WIFEXITED(w.status) || WEXITSTATUS(w.status) != 2) return "";
  return "\n  exit code 2 is the program's own (a command-line parser such as argparse exits 2 on a bad argument: check "
         "the arguments after PROGRAM); cohort run's own bad input stops it before any worker starts";
}

std::string Job::missing_module_hint(const std::vector<std::string>& tail) const {
  // The usual cause of `No module named 'torch'` under cohort: python3 on PATH is not the Python that
  // has it (a pyenv shim, a venv that is not active, a conda base), while the script ran fine by hand
  // with another. Name the interpreter that ran and how to choose another.
  if (plan_.form.kind == "direct") return "";
  const bool missing = std::any_of(tail.begin(), tail.end(), [](const std::string& line) {
    return line.find("ModuleNotFoundError: ") != std::string::npos ||
           line.find("ImportError: ") != std::string::npos;
  });
  if (!missing) return "";
  const std::string named = plan_.form.python + (plan_.form.python_source == "default"
                                                     ? ", the default"
                                                     : ", from " + plan_.form.python_source);
  return fmt::format("\n  the interpreter that ran was {} ({}{}): a module it cannot import may be installed for another "
                     "Python; --python PATH or COHORT_PYTHON=PATH chooses that one",
                     plan_.program_path, named,
                     plan_.program_path == plan_.form.python ? "" : ", found on PATH");
}

std::string Job::describe_worker_exit(const Worker& w) {
  std::string s = describe_status(w.status);
  if (!WIFSIGNALED(w.status) || WTERMSIG(w.status) != SIGKILL) return s;
  KillEvidence e;
  e.pid = w.pid;
  e.sent_by_launcher = w.sigkill_sent;
  if (!e.sent_by_launcher) {
    // The kernel raises the cgroup's count before it sends the SIGKILL, so a count read after the
    // worker died includes its own kill.
    e.counter_file = oom_at_start_.file;
    e.oom_kills_before = oom_at_start_.kills;
    e.oom_kills_after = read_oom_kills(oom_at_start_.file);
    if (auto log = read_kernel_log()) {
      auto since = std::chrono::duration_cast<std::chrono::microseconds>(w.started.time_since_epoch()).count();
      // The log's clock and CLOCK_MONOTONIC may differ by a little: a second's slack, still long after
      // any earlier process with this pid.
      e.kernel_log_names_pid = kernel_log_reports_oom_kill(*log, w.pid, since - 1000000);
    }
  }
  return s + sigkill_note(e);
}

}  // namespace cohort::launch::job_detail

namespace cohort::launch {

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return fmt::format("was killed by {}", job_detail::signal_name(sig));
  }
  return "ended";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace cohort::launch
