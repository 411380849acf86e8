// Who killed a SIGKILLed worker (launch/oom.h): the out-of-memory killer is named only when the kernel
// reported an OOM kill. Unit tests of the readings (cgroup files, memory.events, the kernel log) and
// of the decision, then real jobs: a worker SIGKILLed from outside, and a worker the OOM killer really
// kills inside a memory cgroup of the test's own (skipped, with the reason, where the machine does not
// allow making one).
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "launch/oom.h"
#include "support/test_support.h"

namespace cohort::launch {
namespace {

const char* kMountinfo =
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n"
    "36 31 0:33 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";

TEST(OomCounterFiles, V2AndV1MemoryCgroupsAreFoundUnderTheirMounts) {
  std::string cgroup = "4:memory:/jobs/42\n1:cpu,cpuacct:/\n0::/user.slice/session-1.scope\n";
  auto files = oom_counter_files(cgroup, kMountinfo);
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0], "/sys/fs/cgroup/unified/user.slice/session-1.scope/memory.events");
  EXPECT_EQ(files[1], "/sys/fs/cgroup/memory/jobs/42/memory.oom_control");
}

TEST(OomCounterFiles, AContainersCgroupMountedFromASubfolder) {
  // The container sees its own cgroup as the mount's root; /proc/self/cgroup names the full path.
  std::string mountinfo =
      "600 590 0:40 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
      "601 590 0:41 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n";
  EXPECT_EQ(oom_counter_files("4:memory:/docker/abc/worker\n", mountinfo),
            std::vector<std::string>{"/sys/fs/cgroup/memory/worker/memory.oom_control"});
  EXPECT_EQ(oom_counter_files("0::/kubepods/pod1\n", mountinfo),
            std::vector<std::string>{"/sys/fs/cgroup/memory.events"});
  // A cgroup outside what is mounted here cannot be read.
  EXPECT_TRUE(oom_counter_files("0::/elsewhere\n", mountinfo).empty());
  EXPECT_TRUE(oom_counter_files("0::/\n", "").empty());
}

TEST(OomCounterFiles, MountPointsWithEscapedSpaces) {
  std::string mountinfo = "41 31 0:38 / /mnt/cg\\0402 rw - cgroup2 cgroup2 rw\n";
  EXPECT_EQ(oom_counter_files("0::/a\n", mountinfo), std::vector<std::string>{"/mnt/cg 2/a/memory.events"});
}

TEST(ParseOomKills, MemoryEventsAndOomControl) {
  EXPECT_EQ(parse_oom_kills("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n"), 2);
  EXPECT_EQ(parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n"), 7);
  EXPECT_EQ(parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n"), std::nullopt);  // kernels before 4.13
  EXPECT_EQ(parse_oom_kills(""), std::nullopt);
}

TEST(KernelLog, AnOomKillOfThePidSinceTheWorkerStarted) {
  std::string log =
      "6,100,1000000,-;eth0: link up\n"
      "3,101,5000000,-;Memory cgroup out of memory: Killed process 4242 (tail) total-vm:1048576kB, anon-rss:98304kB\n"
      " SUBSYSTEM=memory\n"
      "3,102,7000000,-;Out of memory: Killed process 777 (python) total-vm:2kB\n";
  EXPECT_TRUE(kernel_log_reports_oom_kill(log, 4242, 4000000));
  EXPECT_TRUE(kernel_log_reports_oom_kill(log, 777, 6000000));
  EXPECT_FALSE(kernel_log_reports_oom_kill(log, 4242, 6000000)) << "an earlier process with the same pid";
  EXPECT_FALSE(kernel_log_reports_oom_kill(log, 424, 0));
  EXPECT_FALSE(kernel_log_reports_oom_kill(log, 42420, 0));
  EXPECT_FALSE(kernel_log_reports_oom_kill(log, 1000, 0));
}

TEST(SigkillNote, TheOomKillerOnlyWhenTheKernelSaysSo) {
  KillEvidence launcher;
  launcher.pid = 10;
  launcher.sent_by_launcher = true;
  launcher.oom_kills_before = 0;
  launcher.oom_kills_after = 5;
  launcher.kernel_log_names_pid = true;
  EXPECT_EQ(sigkill_note(launcher), "") << "the launcher's own SIGKILL is no news, even in a job that hit OOM";

  KillEvidence counted;
  counted.pid = 10;
  counted.oom_kills_before = 2;
  counted.oom_kills_after = 3;
  counted.counter_file = "/cg/memory.events";
  EXPECT_EQ(sigkill_note(counted),
            " from the kernel's out-of-memory killer (the job's memory cgroup counted 1 OOM kill while it ran, "
            "/cg/memory.events; see dmesg)");

  KillEvidence logged;
  logged.pid = 10;
  logged.kernel_log_names_pid = true;
  EXPECT_EQ(sigkill_note(logged),
            " from the kernel's out-of-memory killer (the kernel log says it killed pid 10; see dmesg)");

  KillEvidence quiet = counted;
  quiet.oom_kills_before = 3;
  quiet.kernel_log_names_pid = false;
  EXPECT_EQ(sigkill_note(quiet), ", not sent by cohort run (the kernel reported no out-of-memory kill)");

  KillEvidence unknown;
  unknown.pid = 10;
  EXPECT_EQ(sigkill_note(unknown), ", not sent by cohort run") << "no kernel evidence readable: memory is not blamed";
}

}  // namespace
}  // namespace cohort::launch

namespace cohort::test {
namespace {

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(OomHint, AWorkerSigkilledFromOutsideIsNotBlamedOnMemory) {
  TempDir dir;
  ProcessResult r;
  std::thread job([&] {
    r = run_process({cohort_tool(), "run", "-n", "2", "/bin/sh", "-c",
                     "echo $$ > " + dir.path() + "/pid.$RANK.tmp && mv " + dir.path() + "/pid.$RANK.tmp " +
                         dir.path() + "/pid.$RANK && exec sleep 30"},
                    {}, 60);
  });
  std::string pid_file = dir.file("pid.1");
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!std::filesystem::exists(pid_file) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::string pid = read_file(pid_file);
  if (!pid.empty()) kill(std::stoi(pid), SIGKILL);
  job.join();
  ASSERT_FALSE(pid.empty()) << "rank 1 never started: " << r.err;
  EXPECT_EQ(r.exit_code, 137) << r.err;
  EXPECT_EQ(count(r.err, "was killed by SIGKILL, not sent by cohort run"), 1) << r.err;
  EXPECT_EQ(r.err.find("out-of-memory killer"), std::string::npos) << r.err;
}

// A memory cgroup of the test's own under the test's (cgroup v2 or the v1 memory controller), limited
// to `limit` bytes without swap, removed when the object dies. why_not says why there is none.
class MemoryCgroup {
 public:
  explicit MemoryCgroup(uint64_t limit) {
    std::ifstream cg("/proc/self/cgroup"), mi("/proc/self/mountinfo");
    std::stringstream a, b;
    a << cg.rdbuf();
    b << mi.rdbuf();
    auto files = launch::oom_counter_files(a.str(), b.str());
    if (files.empty()) {
      why_not = "no memory cgroup of this process is mounted here";
      return;
    }
    for (const auto& counter : files) {
      std::filesystem::path parent = std::filesystem::path(counter).parent_path();
      bool v2 = std::filesystem::path(counter).filename() == "memory.events";
      std::string dir = (parent / ("cohort-oom-test-" + std::to_string(getpid()))).string();
      if (mkdir(dir.c_str(), 0755) != 0) {
        why_not += "cannot create " + dir + ": " + strerror(errno) + "; ";
        continue;
      }
      dir_ = dir;
      bool ok = write(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"), std::to_string(limit));
      if (!ok) {
        why_not += "cannot limit the memory of " + dir + " (the memory controller is not enabled for it); ";
        remove();
        continue;
      }
      // No swap: the limit must end in an OOM kill, not in swapping (absent files: no swap accounting).
      if (v2) write(dir + "/memory.swap.max", "0");
      else write(dir + "/memory.memsw.limit_in_bytes", std::to_string(limit));
      procs = dir + "/cgroup.procs";
      why_not.clear();
      return;
    }
  }
  ~MemoryCgroup() { remove(); }
  std::string procs;  // write a pid here to move the process in
  std::string why_not;

 private:
  static bool write(const std::string& path, const std::string& value) {
    std::ofstream out(path);
    out << value;
    out.flush();
    return bool(out);
  }
  void remove() {
    if (dir_.empty()) return;
    // The processes that were in it are gone (reaped); the kernel may take a moment to let go.
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (rmdir(dir_.c_str()) != 0 && errno == EBUSY && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    dir_.clear();
  }
  std::string dir_;
};

TEST(OomHint, AWorkerTheOutOfMemoryKillerKillsIsNamedOnce) {
  // 96 MiB for the launcher and its workers; rank 0 (tail reading /dev/zero keeps its one endless
  // line in memory) grows until the kernel kills it, rank 1 waits. The kernel kills the process of the
  // largest badness, its RSS plus oom_score_adj x limit / 1000: rank 0's 1000 decides only while the
  // limit is well above the launcher's own RSS. Under ASan the launcher holds about 160 MB (shadow
  // memory, quarantine), and with 96 MiB the kernel killed it instead: there, 1 GiB (tail fills it in
  // well under a second).
#if defined(COHORT_TEST_UNDER_ASAN)
  MemoryCgroup cgroup(1ull << 30);
#else
  MemoryCgroup cgroup(96ull << 20);
#endif
  if (cgroup.procs.empty()) GTEST_SKIP() << "no memory cgroup for the test: " << cgroup.why_not;
  std::string worker =
      "if [ $RANK = 0 ]; then echo 1000 > /proc/self/oom_score_adj; exec tail -n 1 /dev/zero; else exec sleep 30; fi";
  // The shell moves itself into the cgroup, then becomes the launcher: its workers start there.
  std::string launcher =
      "echo $$ > " + cgroup.procs + " && exec " + cohort_tool() + " run -n 2 /bin/sh -c '" + worker + "'";
  auto r = run_process({"/bin/sh", "-c", launcher}, {}, 60);
  EXPECT_EQ(r.exit_code, 137) << r.err;
  EXPECT_TRUE(r.err.find("rank 0") != std::string::npos && r.err.find("was killed by SIGKILL from the kernel's "
                                                                      "out-of-memory killer") != std::string::npos)
      << r.err;
  EXPECT_EQ(count(r.err, "out-of-memory killer"), 1) << r.err;
}

}  // namespace
}  // namespace cohort::test
