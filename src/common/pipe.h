#pragma once
// Pipes whose ends are owned (UniqueFd) from the moment they exist, and the one line that says why a
// descriptor could not be made.

#include <string>

#include "common/fd.h"

namespace cohort {

// Both ends of a pipe: an error between creating it and handing its ends on (a second pipe that cannot
// be made, a failed fork) closes them instead of leaking them.
struct Pipe {
  UniqueFd read_end, write_end;
};

// pipe2(O_CLOEXEC): no child inherits an end unless it dup2()s it onto its own stdio. Throws Error
// "<what>: pipe2: <cause>" (describe_fd_error).
Pipe make_pipe(const std::string& what);

// "<what>: <strerror(err)>", and when the cause is an exhausted descriptor table, which limit and how
// to raise it: EMFILE is this process's RLIMIT_NOFILE (its value is named), ENFILE the system's.
std::string describe_fd_error(const std::string& what, int err);

}  // namespace cohort
