#include "common/pipe.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/resource.h>

#include <fmt/core.h>

#include "cohort/error.h"

namespace cohort {

Pipe make_pipe(const std::string& what) {
  int ends[2];
  if (::pipe2(ends, O_CLOEXEC) != 0) throw Error(describe_fd_error(what + ": pipe2", errno));
  return Pipe{UniqueFd(ends[0]), UniqueFd(ends[1])};
}

std::string describe_fd_error(const std::string& what, int err) {
  std::string line = fmt::format("{}: {}", what, strerror(err));
  rlimit limit{};
  if (err == EMFILE && ::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    // Who can raise it: anyone up to the hard limit; beyond it, the administrator.
    const std::string how =
        limit.rlim_max == RLIM_INFINITY ? "raise it with ulimit -n"
        : limit.rlim_cur < limit.rlim_max
            ? fmt::format("raise it with ulimit -n, up to the hard limit {}", static_cast<unsigned long long>(limit.rlim_max))
            : "it is the hard limit too: raise that in /etc/security/limits.conf (nofile) or the service's LimitNOFILE";
    line += fmt::format(" (this process may have {} open at once, RLIMIT_NOFILE: {})",
                        static_cast<unsigned long long>(limit.rlim_cur), how);
  } else if (err == ENFILE) {
    line += " (the system's table of open files is full: fs.file-max)";
  }
  return line;
}

}  // namespace cohort
