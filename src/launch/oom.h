#pragma once
// Who killed a worker with SIGKILL: the launcher itself (stopping the job), the kernel's
// out-of-memory killer, or someone else. Only the kernel can say it was the OOM killer, in two
// places the launcher reads:
//  * the memory cgroup's count of OOM kills: cgroup v2 `memory.events` ("oom_kill N", the cgroup and
//    its descendants), or the v1 memory controller's `memory.oom_control` ("oom_kill N", the cgroup
//    itself). The workers start in the launcher's cgroup, so a count that grew while a worker ran
//    says the OOM killer struck in the job's cgroup;
//  * the kernel log (/dev/kmsg, where readable): "Killed process <pid> (...)" names the victim.
// Without either, a SIGKILL is not blamed on memory (docs/launcher.md, "Failure policy").

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cohort::launch {

// The files that would count the OOM kills of the cgroup in `proc_cgroup` (the text of
// /proc/<pid>/cgroup), given the mounts in `mountinfo` (the text of /proc/self/mountinfo): the v2
// memory.events first, then the v1 memory.oom_control. A cgroup mounted from a subfolder (a
// container's) is found under its mount point.
std::vector<std::string> oom_counter_files(const std::string& proc_cgroup, const std::string& mountinfo);
// The "oom_kill N" count in a memory.events or memory.oom_control text.
std::optional<int64_t> parse_oom_kills(const std::string& text);

// This process's cgroup's OOM kill count now, and the file it came from.
struct OomCounter {
  std::string file;             // "" when no cgroup counts OOM kills here (no memory controller, root cgroup)
  std::optional<int64_t> kills;
};
OomCounter read_oom_counter();
// The count in `file` now (nullopt when unreadable).
std::optional<int64_t> read_oom_kills(const std::string& file);

// Whether the kernel log's records (the text of /dev/kmsg: "prio,seq,usec,flags;message", one a line)
// report the OOM killer killing `pid` at or after `since_us` (microseconds since boot).
bool kernel_log_reports_oom_kill(const std::string& records, pid_t pid, int64_t since_us);
// The kernel log's records, or nullopt where /dev/kmsg is not readable (no permission, no device).
std::optional<std::string> read_kernel_log();

// What is known about one worker's SIGKILL.
struct KillEvidence {
  pid_t pid = 0;
  bool sent_by_launcher = false;             // the launcher sent it SIGKILL (the stop's last step)
  std::optional<int64_t> oom_kills_before;   // the cgroup's count when the worker started
  std::optional<int64_t> oom_kills_after;    // ... and when it was found dead
  std::string counter_file;
  std::optional<bool> kernel_log_names_pid;  // nullopt: the kernel log was not readable
};
// What follows "was killed by SIGKILL" in the failure summary: nothing for the launcher's own
// SIGKILL, the OOM killer only when the kernel reported an OOM kill, otherwise that the signal came
// from outside cohort run.
std::string sigkill_note(const KillEvidence& e);

}  // namespace cohort::launch
