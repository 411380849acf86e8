#pragma once
// The launcher's default trace folders, $TMPDIR/cohort-traces-<uid>/<job id> (flight recorder dumps of
// a failed attempt, the timeline's rank files): kept only when a failure left something in them, and
// bounded.
//  * They live in a folder of this user's only (mode 0700; docs/security.md): job ids are predictable,
//    and a folder another user made, or a link planted at its name, would receive the dumps and have
//    them removed at the end. A parent folder that is not this user's own is refused, never used.
//  * A job claims its folder when it starts: it creates it with a mark file (kTraceDirMark) and holds
//    a shared flock(2) on the mark while it runs (launchers of one job on one host share the folder).
//  * When the job ends, the folder is removed, unless the job failed and left files in it; the
//    summary names a folder that is kept.
//  * A kept folder stays COHORT_TRACE_KEEP_DAYS days after its job ended, whatever else runs: when a
//    job starts, it removes the finished folders next to its own (marked, not locked, owned by this
//    user) whose job ended longer ago than that, and only those. So the summary's "kept" holds for a
//    known time: another job of the same user (or another user's) never shortens it. A folder without
//    the mark was not made by this version of cohort and is never touched; a user's --trace-dir /
//    COHORT_TRACE_DIR is never claimed, so never removed.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/fd.h"

namespace cohort::launch {

inline constexpr const char* kTraceDirMark = ".cohort-trace-dir";

// The default trace folder of job `job_id`: `tmpdir`/cohort-traces-<effective uid>/<job id> (a job id's
// characters other than letters, digits, '.', '_' and '-' become '_', and a leading '.' too, so that
// the id names one folder inside the parent).
std::string default_trace_dir(const std::string& tmpdir, const std::string& job_id);

// How many days a finished default trace folder stays (COHORT_TRACE_KEEP_DAYS).
int64_t trace_keep_days();

// Removes the finished trace folders in `parent` whose job ended (the mark's modification time) more
// than `keep` before `now`. Returns the folders removed.
std::vector<std::string> prune_trace_dirs(const std::string& parent, std::chrono::system_clock::duration keep,
                                          std::chrono::system_clock::time_point now);

class TraceDirClaim {
 public:
  // Makes `dir`'s parent and `dir` this user's private folders (files::ensure_private_dir), creates the
  // mark, and takes the shared lock. Throws Error when it cannot, or when either folder is not this
  // user's own (naming its owner).
  TraceDirClaim(const std::string& dir, const std::string& job_id);
  TraceDirClaim(const TraceDirClaim&) = delete;
  TraceDirClaim& operator=(const TraceDirClaim&) = delete;
  ~TraceDirClaim() { release(true); }  // the job ended by an exception: what it left is kept

  const std::string& dir() const { return dir_; }
  // The job is over. `failed`: the folder stays when it holds anything besides the mark, and the mark
  // records the end (its time orders the pruning). Otherwise, or after a success, it is removed,
  // unless another launcher of the job still holds it (it removes it when it ends). Returns whether
  // the folder is kept.
  bool release(bool failed);

 private:
  std::string dir_;
  UniqueFd mark_;
};

}  // namespace cohort::launch
