#include "launch/trace_dirs.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <filesystem>
#include <thread>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/env.h"
#include "common/private_files.h"
#include "common/socket.h"

namespace cohort::launch {
namespace {

const env::IntSetting kTraceKeepDays(
    "COHORT_TRACE_KEEP_DAYS", 7,
    "days a failed job's trace folder $TMPDIR/cohort-traces-<uid>/<job id> (its flight recorder dumps) stays "
    "after the job ended; a later job of the same user removes it after that (0: the next job start removes it)");

// The mark of a folder this user's cohort made, opened (without following links); invalid otherwise.
UniqueFd open_mark(const std::filesystem::path& dir) {
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid()) return UniqueFd();
  UniqueFd fd(::open((dir / kTraceDirMark).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd || fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) return UniqueFd();
  return fd;
}

}  // namespace

std::string default_trace_dir(const std::string& tmpdir, const std::string& job_id) {
  std::string name = job_id.empty() ? "_" : job_id;
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  if (name.front() == '.') name.front() = '_';  // never ".." or a hidden folder
  return fmt::format("{}/cohort-traces-{}/{}", tmpdir, geteuid(), name);
}

int64_t trace_keep_days() {
  int64_t days = kTraceKeepDays.get();
  // (Beyond about 290 years, days as a clock duration would overflow.)
  if (days < 0 || days > 36500)
    throw ConfigError(fmt::format("COHORT_TRACE_KEEP_DAYS={}: expected a number of days, 0 to 36500", days));
  return days;
}

std::vector<std::string> prune_trace_dirs(const std::string& parent, std::chrono::system_clock::duration keep,
                                          std::chrono::system_clock::time_point now) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(parent, ec)) {
    UniqueFd mark = open_mark(entry.path());
    // Held while the folder goes: a running job holds a shared lock on its mark, and a job of the same
    // id that starts meanwhile waits for this one, then makes a new folder.
    if (!mark || flock(mark.get(), LOCK_EX | LOCK_NB) != 0) continue;
    struct stat st;
    if (fstat(mark.get(), &st) != 0) continue;
    const auto ended = std::chrono::system_clock::time_point(std::chrono::duration_cast<std::chrono::system_clock::duration>(
        std::chrono::seconds(st.st_mtim.tv_sec) + std::chrono::nanoseconds(st.st_mtim.tv_nsec)));
    if (now - ended <= keep) continue;  // the summary promised it this long
    std::error_code rm;
    std::filesystem::remove_all(entry.path(), rm);
    if (!rm) removed.push_back(entry.path().string());
  }
  return removed;
}

TraceDirClaim::TraceDirClaim(const std::string& dir, const std::string& job_id) : dir_(dir) {
  const std::string mark = dir + "/" + kTraceDirMark;
  // A start's pruning may be removing an old folder of the same name (a job id used again) right now:
  // it takes well under a second; then the folder is made anew.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (;;) {
    // Both folders are this user's only: nobody else can put anything in them (a link where a dump
    // goes) or take the dumps.
    files::ensure_private_dir(std::filesystem::path(dir).parent_path().string());
    files::ensure_private_dir(dir);
    UniqueFd fd(::open(mark.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (!fd) throw Error(net::errno_string("cannot create " + mark, errno));
    struct stat st;
    if (flock(fd.get(), LOCK_SH | LOCK_NB) == 0 && fstat(fd.get(), &st) == 0 && st.st_nlink > 0) {
      if (st.st_size == 0) {
        std::string text = fmt::format(
            "cohort run's trace folder of job {} (launcher pid {}). It is removed when the job succeeds, or "
            "when a job starts more than COHORT_TRACE_KEEP_DAYS days after this one ended (this file's "
            "modification time).\n",
            job_id, getpid());
        [[maybe_unused]] auto w = ::write(fd.get(), text.data(), text.size());
      }
      mark_ = std::move(fd);
      return;
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(fmt::format("cannot lock {}: another cohort run is removing the folder", mark));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool TraceDirClaim::release(bool failed) {
  if (!mark_) return false;
  bool has_files = false;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec))
    if (entry.path().filename() != kTraceDirMark) has_files = true;
  if (failed && has_files) {
    futimens(mark_.get(), nullptr);  // when the job ended: the pruning keeps the newest
    mark_.reset();
    return true;
  }
  // Several launchers of the job on this host share the folder: the last one out removes it. (A lock
  // that cannot be made exclusive is dropped: another holder is still running.)
  if (flock(mark_.get(), LOCK_EX | LOCK_NB) == 0) std::filesystem::remove_all(dir_, ec);
  mark_.reset();
  return false;
}

}  // namespace cohort::launch
