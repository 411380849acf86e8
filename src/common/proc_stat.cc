#include "common/proc_stat.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/fd.h"

namespace cohort {

std::optional<ProcStat> parse_proc_stat(const std::string& text) {
  // The name (field 2) may hold spaces and parentheses: it ends at the last ')'.
  const size_t open = text.find('('), close = text.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close < open || close + 2 >= text.size() ||
      text[close + 1] != ' ')
    return std::nullopt;
  ProcStat st;
  st.name = text.substr(open + 1, close - open - 1);
  st.state = text[close + 2];
  const char* p = text.c_str() + close + 2;  // at field 3
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (!p) return std::nullopt;
    ++p;
    if (field == 3) st.ppid = static_cast<pid_t>(std::atol(p));  // now at field 4
  }
  st.start_ticks = std::strtoull(p, nullptr, 10);
  return st;
}

std::optional<ProcStat> read_proc_stat(pid_t pid) {
  char path[40];
  std::snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
  UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd) return std::nullopt;
  // One read: the kernel writes the whole file at once, and it is well under this size (the name
  // is at most 64 bytes).
  char buf[1024];
  const ssize_t n = ::read(fd.get(), buf, sizeof buf - 1);
  if (n <= 0) return std::nullopt;
  return parse_proc_stat(std::string(buf, size_t(n)));
}

}  // namespace cohort
