#include "launch/oom.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <sstream>

#include <fmt/core.h>

#include "common/fd.h"
#include "common/io.h"
#include "common/strings.h"

namespace cohort::launch {
namespace {

// A file that cannot be read counts as empty: no cgroup, no counter.
std::string read_text(const std::string& path) { return io::read_file(path).value_or(""); }

// mountinfo escapes spaces, tabs, newlines and backslashes in paths as \ooo.
std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      out += static_cast<char>(std::stoi(s.substr(i + 1, 3), nullptr, 8));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

struct Mount {
  std::string root, point, fstype;
  std::vector<std::string> super_options;
};

std::vector<Mount> cgroup_mounts(const std::string& mountinfo) {
  std::vector<Mount> out;
  std::istringstream in(mountinfo);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::vector<std::string> fields;
    for (std::string w; f >> w;) fields.push_back(w);
    // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS
    size_t dash = 6;
    while (dash < fields.size() && fields[dash] != "-") ++dash;
    if (dash + 3 >= fields.size()) continue;
    Mount m{unescape(fields[3]), unescape(fields[4]), fields[dash + 1], str::split(fields[dash + 3], ',')};
    if (m.fstype == "cgroup2" || m.fstype == "cgroup") out.push_back(std::move(m));
  }
  return out;
}

// The folder of cgroup `path` under mount `m`, or "" when the mount does not show it.
std::string folder_of(const Mount& m, const std::string& path) {
  if (m.root == "/") return m.point + (path == "/" ? "" : path);
  if (path == m.root) return m.point;
  if (path.rfind(m.root + "/", 0) == 0) return m.point + path.substr(m.root.size());
  return "";
}

}  // namespace

std::vector<std::string> oom_counter_files(const std::string& proc_cgroup, const std::string& mountinfo) {
  std::string v2_path, v1_memory_path;
  std::istringstream in(proc_cgroup);
  std::string line;
  while (std::getline(in, line)) {
    // ID:CONTROLLERS:PATH (the path may itself hold ':')
    auto a = line.find(':');
    auto b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (id == "0" && controllers.empty()) v2_path = path;
    for (const auto& c : str::split(controllers, ','))
      if (c == "memory") v1_memory_path = path;
  }
  std::vector<std::string> out;
  auto mounts = cgroup_mounts(mountinfo);
  if (!v2_path.empty())
    for (const auto& m : mounts)
      if (m.fstype == "cgroup2")
        if (auto dir = folder_of(m, v2_path); !dir.empty()) out.push_back(dir + "/memory.events");
  if (!v1_memory_path.empty())
    for (const auto& m : mounts) {
      bool memory = false;
      for (const auto& o : m.super_options) memory = memory || o == "memory";
      if (m.fstype == "cgroup" && memory)
        if (auto dir = folder_of(m, v1_memory_path); !dir.empty()) out.push_back(dir + "/memory.oom_control");
    }
  return out;
}

std::optional<int64_t> parse_oom_kills(const std::string& text) {
  std::istringstream in(text);
  std::string key;
  int64_t value = 0;
  while (in >> key >> value)
    if (key == "oom_kill") return value;
  return std::nullopt;
}

std::optional<int64_t> read_oom_kills(const std::string& file) {
  if (file.empty()) return std::nullopt;
  return parse_oom_kills(read_text(file));
}

OomCounter read_oom_counter() {
  for (const auto& file : oom_counter_files(read_text("/proc/self/cgroup"), read_text("/proc/self/mountinfo")))
    if (auto kills = read_oom_kills(file)) return {file, kills};
  return {};
}

bool kernel_log_reports_oom_kill(const std::string& records, pid_t pid, int64_t since_us) {
  const std::string needle = fmt::format("Killed process {} (", pid);
  std::istringstream in(records);
  std::string line;
  while (std::getline(in, line)) {
    auto semi = line.find(';');
    if (semi == std::string::npos || line.find(needle, semi) == std::string::npos) continue;
    auto fields = str::split(line.substr(0, semi), ',', /*keep_empty=*/true);  // prio,seq,time,...
    if (fields.size() < 3) continue;
    try {
      if (std::stoll(fields[2]) >= since_us) return true;
    } catch (const std::exception&) {
    }
  }
  return false;
}

std::optional<std::string> read_kernel_log() {
  UniqueFd fd(::open("/dev/kmsg", O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (!fd) return std::nullopt;
  std::string out;
  char buf[8192];  // one record per read; a record is at most about 1 KiB of text plus its dictionary
  // The kernel's buffer is bounded (a few MiB at most); the cap only guards against a log that keeps
  // growing faster than it is read.
  while (out.size() < (size_t(32) << 20)) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n > 0) {
      out.append(buf, size_t(n));
      if (buf[n - 1] != '\n') out += '\n';
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EPIPE) continue;  // the record was overwritten while read: the next one follows
    if (n < 0 && errno != EAGAIN && out.empty()) return std::nullopt;  // EPERM and the like: not readable
    break;
  }
  return out;
}

std::string sigkill_note(const KillEvidence& e) {
  if (e.sent_by_launcher) return "";
  if (e.kernel_log_names_pid.value_or(false))
    return fmt::format(" from the kernel's out-of-memory killer (the kernel log says it killed pid {}; see dmesg)",
                       e.pid);
  if (e.oom_kills_before && e.oom_kills_after && *e.oom_kills_after > *e.oom_kills_before) {
    int64_t kills = *e.oom_kills_after - *e.oom_kills_before;
    return fmt::format(" from the kernel's out-of-memory killer (the job's memory cgroup counted {} OOM kill{} while "
                       "it ran, {}; see dmesg)",
                       kills, kills == 1 ? "" : "s", e.counter_file);
  }
  bool kernel_asked = (e.oom_kills_before && e.oom_kills_after) || e.kernel_log_names_pid;
  return kernel_asked ? ", not sent by cohort run (the kernel reported no out-of-memory kill)"
                      : ", not sent by cohort run";
}

}  // namespace cohort::launch
