// The launcher's default trace folders ($TMPDIR/cohort-<job id>, launch/trace_dirs.h) with real jobs:
// removed after a success, kept (and named) after a failure, never a user's --trace-dir, and bounded
// in time: a job start removes the finished folders older than COHORT_TRACE_KEEP_DAYS and no other,
// however many there are, never a folder cohort did not make or one whose job still runs.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "support/cohort_run.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

namespace fs = std::filesystem;

const char* kMark = ".cohort-trace-dir";

std::vector<std::string> concat_args(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// This user's folder of default trace folders under the TMPDIR `tmp`.
std::string user_traces(const TempDir& tmp) { return tmp.file("cohort-traces-" + std::to_string(geteuid())); }

// The folders in `dir` (none when it does not exist), by name.
std::vector<std::string> folders_in(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The default trace folders of jobs started with TMPDIR `tmp`, by name (the job id).
std::vector<std::string> trace_folders(const TempDir& tmp) { return folders_in(user_traces(tmp)); }

// One allreduce per rank (so the flight recorders have something to dump), then exit 3 on the first
// attempt and 0 on a restart.
std::vector<std::string> fail_first_attempt() {
  return {"/bin/sh", "-c",
          std::string(COHORT_COMM_WORKER) + " once env 0 0 && [ \"$TORCHELASTIC_RESTART_COUNT\" != 0 ] || exit 3"};
}

TEST(TraceFolders, ASuccessRemovesTheDefaultFolderButNotTheUsersOne) {
  TempDir tmp;
  // Attempt 0 fails and leaves its dumps; the restart succeeds.
  auto r = run_process(concat_args(cohort_run({"-n", "2", "--max-restarts", "1"}), fail_first_attempt()),
                  {"TMPDIR=" + tmp.path(), "COHORT_TIMEOUT=20"}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("restarting every worker"), std::string::npos) << r.err;
  EXPECT_EQ(trace_folders(tmp), std::vector<std::string>{}) << r.err;

  // The same with --trace-dir: the user's folder keeps the first attempt's dumps.
  std::string mine = tmp.file("my-traces");
  r = run_process(
      concat_args(cohort_run({"-n", "2", "--max-restarts", "1", "--trace-dir", mine}), fail_first_attempt()),
      {"TMPDIR=" + tmp.path(), "COHORT_TIMEOUT=20"}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(mine + "/rank0.json")) << r.err;
  EXPECT_FALSE(fs::exists(mine + "/" + kMark)) << "cohort claimed the user's folder";
}

TEST(TraceFolders, AFailureKeepsTheFolderAndTheSummaryNamesIt) {
  TempDir tmp;
  auto r = run_process(concat_args(cohort_run({"-n", "2"}), {"/bin/sh", "-c", std::string(COHORT_COMM_WORKER) +
                                                                                  " once env 0 0; exit 3"}),
                       {"TMPDIR=" + tmp.path(), "COHORT_TIMEOUT=20"}, 60);
  ASSERT_EQ(r.exit_code, 3) << r.err;
  auto folders = trace_folders(tmp);
  ASSERT_EQ(folders.size(), 1u) << r.err;
  std::string kept = user_traces(tmp) + "/" + folders[0];
  EXPECT_TRUE(fs::exists(kept + "/rank0.json")) << r.err;
  EXPECT_TRUE(fs::exists(kept + "/" + kMark)) << r.err;
  EXPECT_NE(r.err.find("trace folder kept: " + kept + " "), std::string::npos) << r.err;
  // How long it stays, and the setting that says so.
  EXPECT_NE(r.err.find(" for 7 days: a job that starts after "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("removes it (COHORT_TRACE_KEEP_DAYS)"), std::string::npos) << r.err;

  // A failure that left nothing to read (no rank communicated) keeps nothing.
  TempDir tmp2;
  r = run_process(cohort_run({"-n", "2", "/bin/sh", "-c", "exit 3"}), {"TMPDIR=" + tmp2.path()}, 60);
  ASSERT_EQ(r.exit_code, 3) << r.err;
  EXPECT_EQ(trace_folders(tmp2), std::vector<std::string>{}) << r.err;
  EXPECT_EQ(r.err.find("trace folder kept"), std::string::npos) << r.err;
}

constexpr int kDay = 24 * 3600;

// A finished folder as an earlier job leaves it, its mark `age_s` seconds old (when its job ended).
void make_finished_folder(const std::string& dir, int age_s) {
  fs::create_directories(dir);
  write_file(dir + "/rank0.json", "{}");
  std::string mark = dir + "/" + kMark;
  write_file(mark, "test\n");
  struct timespec times[2];
  clock_gettime(CLOCK_REALTIME, &times[0]);
  times[0].tv_sec -= age_s;
  times[1] = times[0];
  ASSERT_EQ(utimensat(AT_FDCWD, mark.c_str(), times, 0), 0);
}

TEST(TraceFolders, AJobStartRemovesOnlyFoldersOlderThanTheKeptDays) {
  TempDir tmp;
  const std::string traces = user_traces(tmp);
  // Many recent failures (more than any count a start could keep): each stays its 7 days.
  std::vector<std::string> recent;
  for (int i = 0; i < 14; ++i) {
    recent.push_back("cohort-job-recent" + std::to_string(10 + i));
    make_finished_folder(traces + "/" + recent.back(), 3600 + i * (6 * kDay / 14));
  }
  make_finished_folder(traces + "/cohort-job-week-old", 7 * kDay + 3600);
  make_finished_folder(traces + "/cohort-job-month-old", 30 * kDay);
  // Older than all of them, but not cohort's (no mark) / in use (its mark locked, as a running job's is).
  fs::create_directories(traces + "/cohort-job-foreign");
  write_file(traces + "/cohort-job-foreign/rank0.json", "{}");
  make_finished_folder(traces + "/cohort-job-running", 50 * kDay);
  int lock = open((traces + "/cohort-job-running/" + kMark).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(lock, 0);
  ASSERT_EQ(flock(lock, LOCK_SH), 0);

  auto r = run_process(cohort_run({"-n", "1", "/bin/true"}), {"TMPDIR=" + tmp.path()}, 60);
  close(lock);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> want = recent;
  want.insert(want.end(), {"cohort-job-foreign", "cohort-job-running"});
  std::sort(want.begin(), want.end());
  EXPECT_EQ(trace_folders(tmp), want) << r.err;

  // A shorter time, chosen by the user: the folders older than 2 days go too, and the one whose job
  // has ended since (its lock is gone; it ended 50 days ago by its mark).
  r = run_process(cohort_run({"-n", "1", "/bin/true"}), {"TMPDIR=" + tmp.path(), "COHORT_TRACE_KEEP_DAYS=2"}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const auto& name : trace_folders(tmp)) {
    if (name == "cohort-job-foreign") continue;
    struct stat st;
    ASSERT_EQ(stat((traces + "/" + name + "/" + kMark).c_str(), &st), 0) << name;
    EXPECT_LE(time(nullptr) - st.st_mtime, 2 * kDay) << name << " outlived COHORT_TRACE_KEEP_DAYS=2";
  }
  EXPECT_EQ(trace_folders(tmp).size(), 1u + 5u) << r.err;  // foreign; ages 1 h + 0..4 x 6/14 day
}

TEST(TraceFolders, ARunningJobsFolderIsNeverRemoved) {
  TempDir tmp, flags;
  ProcessResult first;
  std::thread job([&] {
    // Waits (at most 30 s) until the test says go.
    first = run_process(cohort_run({"-n", "1", "/bin/sh", "-c",
                                    "touch " + flags.file("up") + "; i=0; while [ ! -e " + flags.file("go") +
                                        " ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done"}),
                        {"TMPDIR=" + tmp.path()}, 60);
  });
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!fs::exists(flags.file("up")) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  auto running = trace_folders(tmp);
  // A second job that keeps no finished folder at all.
  auto second =
      run_process(cohort_run({"-n", "1", "/bin/true"}), {"TMPDIR=" + tmp.path(), "COHORT_TRACE_KEEP_DAYS=0"}, 60);
  auto after = trace_folders(tmp);
  write_file(flags.file("go"), "");
  job.join();
  ASSERT_EQ(first.exit_code, 0) << first.err;
  ASSERT_EQ(second.exit_code, 0) << second.err;
  ASSERT_EQ(running.size(), 1u) << "the running job has its folder";
  EXPECT_EQ(after, running) << second.err;
  EXPECT_EQ(trace_folders(tmp), std::vector<std::string>{}) << "both succeeded: " << first.err;
}

TEST(TraceFolders, ANegativeKeepTimeIsRefused) {
  TempDir tmp;
  auto r =
      run_process(cohort_run({"-n", "1", "/bin/true"}), {"TMPDIR=" + tmp.path(), "COHORT_TRACE_KEEP_DAYS=-1"}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("COHORT_TRACE_KEEP_DAYS=-1: expected a number of days, 0 to 36500"), std::string::npos)
      << r.err;
}

// Every file under `dir`, recursively (none when it does not exist or cannot be listed).
std::vector<std::string> files_under(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec))
    out.push_back(it->path().string());
  return out;
}

// A failing job of job id `id` whose ranks communicated once (its flight recorders have something to dump).
ProcessResult failing_job(const TempDir& tmp, const std::string& id, std::vector<std::string> env = {}) {
  env.push_back("TMPDIR=" + tmp.path());
  env.push_back("COHORT_TIMEOUT=20");
  return run_process(concat_args(cohort_run({"-n", "2", "--rdzv-id", id}),
                                 {"/bin/sh", "-c", std::string(COHORT_COMM_WORKER) + " once env 0 0; exit 3"}),
                     env, 60);
}

// Job ids are predictable (slurm-<id>, job-<addr>-<port>): another user of the node can make the
// default trace folder before the job does, to read its dumps or have links in it followed. The
// folders cohort makes are this user's only (0700), and one another user made is refused: nothing is
// written there, the job runs on, and one line says why.
TEST(TraceFolders, AnotherUsersFolderAtTheDefaultPlaceIsRefusedAndGetsNothing) {
  if (geteuid() != 0) GTEST_SKIP() << "making a folder of another user takes root";
  TempDir tmp;
  const std::string id = "sec-owner";
  // "nobody" makes the folders where a job's default trace folder would go (this version's and the
  // one before's), open to everyone.
  for (const std::string& dir : {user_traces(tmp), user_traces(tmp) + "/" + id, tmp.file("cohort-" + id)}) {
    ASSERT_TRUE(fs::create_directories(dir)) << dir;
    ASSERT_EQ(chown(dir.c_str(), 65534, 65534), 0) << dir;
    ASSERT_EQ(chmod(dir.c_str(), 0777), 0) << dir;
  }
  auto r = failing_job(tmp, id);
  EXPECT_EQ(r.exit_code, 3) << r.err;  // the job ran: its own exit code
  EXPECT_EQ(files_under(user_traces(tmp)), std::vector<std::string>{user_traces(tmp) + "/" + id}) << r.err;
  EXPECT_EQ(files_under(tmp.file("cohort-" + id)), std::vector<std::string>{}) << r.err;
  EXPECT_NE(r.err.find("refusing the folder " + user_traces(tmp) + ": it belongs to "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(uid 65534), not to you"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("flight recorder dumps not written to " + user_traces(tmp) + "/" + id), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("trace folder kept"), std::string::npos) << r.err;
}

// The same with a symbolic link planted where the folder goes (any user can plant one in /tmp): it is
// not followed, and the folder it points to gets nothing.
TEST(TraceFolders, ALinkPlantedAtTheDefaultPlaceIsNotFollowed) {
  TempDir tmp, elsewhere;
  const std::string id = "sec-link";
  ASSERT_EQ(symlink(elsewhere.path().c_str(), user_traces(tmp).c_str()), 0);
  ASSERT_EQ(symlink(elsewhere.path().c_str(), tmp.file("cohort-" + id).c_str()), 0);  // the version before's place
  auto r = failing_job(tmp, id);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_EQ(files_under(elsewhere.path()), std::vector<std::string>{}) << r.err;
  EXPECT_NE(r.err.find("refusing the folder " + user_traces(tmp) + ": it is a symbolic link"), std::string::npos)
      << r.err;
  // With --timeline the ranks' files have nowhere to go: the job does not start, and says why in one line.
  r = run_process(cohort_run({"-n", "1", "--rdzv-id", id, "--timeline", tmp.file("t.json"), "/bin/true"}),
                  {"TMPDIR=" + tmp.path()}, 60);
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("--timeline: refusing the folder " + user_traces(tmp) + ": it is a symbolic link"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(files_under(elsewhere.path()), std::vector<std::string>{}) << r.err;
}

// The folders cohort makes are closed to other users: the dumps say what the job ran and where.
TEST(TraceFolders, TheDefaultFoldersAreThisUsersOnly) {
  TempDir tmp;
  auto r = failing_job(tmp, "sec-mode");
  ASSERT_EQ(r.exit_code, 3) << r.err;
  for (const std::string& dir : {user_traces(tmp), user_traces(tmp) + "/sec-mode"}) {
    struct stat st;
    ASSERT_EQ(lstat(dir.c_str(), &st), 0) << dir << "\n" << r.err;
    EXPECT_TRUE(S_ISDIR(st.st_mode)) << dir;
    EXPECT_EQ(st.st_mode & 0777, 0700u) << dir;
    EXPECT_EQ(st.st_uid, geteuid()) << dir;
  }
  EXPECT_TRUE(fs::exists(user_traces(tmp) + "/sec-mode/rank0.json")) << r.err;
}

}  // namespace
}  // namespace cohort::test
