#include "launch/trace_dirs.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/env.h"
#include "common/socket.h"

namespace cohort::launch {
namespace {

const env::IntSetting kTraceKeep(
    "COHORT_TRACE_KEEP", 10,
    "cohort run keeps at most this many finished trace folders $TMPDIR/cohort-<job id> (a failed job's flight "
    "recorder dumps): when a job starts, older ones are removed");

// The mark of a folder this user's cohort made, opened (without following links); invalid otherwise.
UniqueFd open_mark(const std::filesystem::path& dir) {
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid()) return UniqueFd();
  UniqueFd fd(::open((dir / kTraceDirMark).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd || fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) return UniqueFd();
  return fd;
}

}  // namespace

int64_t trace_dirs_to_keep() {
  int64_t keep = kTraceKeep.get();
  if (keep < 0) throw ConfigError(fmt::format("COHORT_TRACE_KEEP={}: expected a count >= 0", keep));
  return keep;
}

std::vector<std::string> prune_trace_dirs(const std::string& parent, int64_t keep) {
  struct Finished {
    std::filesystem::path dir;
    std::chrono::nanoseconds ended;
  };
  std::vector<Finished> finished;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(parent, ec)) {
    if (entry.path().filename().string().rfind("cohort-", 0) != 0) continue;
    UniqueFd mark = open_mark(entry.path());
    if (!mark) continue;
    // A running job holds a shared lock on its mark.
    if (flock(mark.get(), LOCK_EX | LOCK_NB) != 0) continue;
    struct stat st;
    if (fstat(mark.get(), &st) != 0) continue;
    finished.push_back(
        {entry.path(), std::chrono::seconds(st.st_mtim.tv_sec) + std::chrono::nanoseconds(st.st_mtim.tv_nsec)});
  }
  std::sort(finished.begin(), finished.end(), [](const auto& a, const auto& b) { return a.ended > b.ended; });
  std::vector<std::string> removed;
  for (size_t i = size_t(keep); i < finished.size(); ++i) {
    // Locked again for the removal: a job of the same id that starts meanwhile waits, then makes a new one.
    UniqueFd mark = open_mark(finished[i].dir);
    if (!mark || flock(mark.get(), LOCK_EX | LOCK_NB) != 0) continue;
    std::filesystem::remove_all(finished[i].dir, ec);
    if (!ec) removed.push_back(finished[i].dir.string());
  }
  return removed;
}

TraceDirClaim::TraceDirClaim(const std::string& dir, const std::string& job_id) : dir_(dir) {
  const std::string mark = dir + "/" + kTraceDirMark;
  // A start's pruning may be removing an old folder of the same name (a job id used again) right now:
  // it takes well under a second; then the folder is made anew.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (;;) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw Error(fmt::format("cannot create the trace folder {}: {}", dir, ec.message()));
    UniqueFd fd(::open(mark.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (!fd) throw Error(net::errno_string("cannot create " + mark, errno));
    struct stat st;
    if (flock(fd.get(), LOCK_SH | LOCK_NB) == 0 && fstat(fd.get(), &st) == 0 && st.st_nlink > 0) {
      if (st.st_size == 0) {
        std::string text = fmt::format(
            "cohort run's trace folder of job {} (launcher pid {}). It is removed when the job succeeds, or when "
            "a later job starts and more than COHORT_TRACE_KEEP newer finished folders are here.\n",
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
