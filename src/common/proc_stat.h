#pragma once
// What /proc/<pid>/stat says of a process, read in one place: the launcher (its orphans, a stopped
// worker), the inspector and the parameter server's table holders all ask it.

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

namespace cohort {

struct ProcStat {
  std::string name;          // field 2, comm, without its parentheses (may hold spaces and parentheses)
  char state = 0;            // field 3: R, S, D, Z, T, t, ...
  pid_t ppid = 0;            // field 4
  uint64_t start_ticks = 0;  // field 22, starttime: clock ticks after boot; with the pid, names one process
};

// nullopt when the process is gone (or the file is not what the kernel writes).
std::optional<ProcStat> read_proc_stat(pid_t pid);

// Parses the text of a /proc/<pid>/stat file ("pid (comm) state ppid ... starttime ...").
std::optional<ProcStat> parse_proc_stat(const std::string& text);

}  // namespace cohort
