// Integration tests of `cohort run` with real processes: the built `cohort` tool starts /bin/sh
// workers; the tests check what the workers saw and did, and that nothing outlives the job.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "common/socket.h"
#include "common/build_info.h"
#include "launch_test_util.h"
#include "support/cohort_run.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

std::vector<std::string> sh(const std::string& script) { return {"/bin/sh", "-c", script}; }

std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Both nodes of a job of 2 nodes x 2 ranks on loopback (node 0 hosts the store at 127.0.0.1:port), each
// node's `cohort run` running `script` under /bin/sh. Node 1 starts on a thread of its own: the joining
// node may start first. Returns {node 0's result, node 1's}.
std::pair<ProcessResult, ProcessResult> two_nodes_on_loopback(int port, const std::string& script) {
  auto node = [&](int rank) {
    return run_process(concat(cohort_run({"--nnodes", "2", "--node-rank", std::to_string(rank), "--master-addr",
                                          "127.0.0.1", "--master-port", std::to_string(port), "--nproc-per-node", "2",
                                          "--join-timeout", "20"}),
                              sh(script)),
                       {}, 60);
  };
  ProcessResult second;
  std::thread t([&] { second = node(1); });
  ProcessResult first = node(0);
  t.join();
  return {first, second};
}

// Reads the pids the workers wrote to dir/pid.N and checks, with a short grace for the kernel to
// deliver the last signals, that none of them is still running.
void expect_no_process_left(const TempDir& dir, int n) {
  std::vector<int> pids;
  for (int r = 0; r < n; ++r) {
    std::string text = read_file(dir.file("pid." + std::to_string(r)));
    if (text.empty()) continue;
    pids.push_back(std::stoi(text));
  }
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  for (int pid : pids) {
    while (process_alive(pid) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(process_alive(pid)) << "worker pid " << pid << " outlived the job";
  }
}

// A daemon a worker leaves behind in a session of its own (setsid, double-forked, its output closed,
// as a daemonised data loader does): sh -c 'echo $$; sleep & echo $!; wait' writes the pids of both of
// its processes to dir/daemon.$RANK. The worker goes on only once both are written.
std::string start_daemon(const TempDir& dir) {
  std::string file = dir.path() + "/daemon.$RANK";
  return "(setsid sh -c 'echo $$ > " + file + ".tmp; sleep 3137 & echo $! >> " + file + ".tmp; mv " + file +
         ".tmp " + file + "; wait' </dev/null >/dev/null 2>&1 &); i=0; while [ ! -s " + file +
         " ] && [ $i -lt 200 ]; do sleep 0.02; i=$((i+1)); done; ";
}

// The pids in dir/daemon.N; checks, with a short grace for the kernel to deliver the last signals,
// that none is still running, and SIGKILLs any that is (so that a failure leaves nothing behind).
void expect_daemon_gone(const TempDir& dir, int rank) {
  std::istringstream in(read_file(dir.file("daemon." + std::to_string(rank))));
  std::vector<int> pids;
  for (int pid; in >> pid;) pids.push_back(pid);
  ASSERT_EQ(pids.size(), 2u) << "rank " << rank << "'s daemon did not start";
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  for (int pid : pids) {
    while (process_alive(pid) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(process_alive(pid)) << "pid " << pid << " of rank " << rank << "'s daemon outlived the job";
    if (process_alive(pid)) kill(pid, SIGKILL);
  }
}

TEST(Run, AWorkersDaemonInASessionOfItsOwnEndsWithTheJob) {
  {  // the worker exits 0 and leaves its daemon running
    TempDir dir;
    auto r = run_process(concat(cohort_run({"-n", "1", "--kill-grace", "2"}), sh(start_daemon(dir) + "exit 0")), {}, 60);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_LT(r.seconds, 10.0) << r.err;  // SIGTERM ends sleep and sh at once: no need for the SIGKILL
    EXPECT_NE(r.err.find("a process was left by the workers outside their process groups: pid "), std::string::npos)
        << r.err;
    expect_daemon_gone(dir, 0);
  }
  {  // the job fails while rank 0's daemon runs
    TempDir dir;
    std::string d = dir.path();
    auto r = run_process(concat(cohort_run({"-n", "2", "--kill-grace", "2"}),
                                sh("if [ $RANK = 0 ]; then " + start_daemon(dir) + "exec sleep 60; fi; i=0; "
                                   "while [ ! -s " + d + "/daemon.0 ] && [ $i -lt 200 ]; do sleep 0.02; i=$((i+1)); "
                                   "done; exit 3")),
                         {}, 60);
    EXPECT_EQ(r.exit_code, 3) << r.err;
    EXPECT_LT(r.seconds, 10.0) << r.err;
    expect_daemon_gone(dir, 0);
  }
  {  // Ctrl-C: SIGINT to the launcher (the worker's parent) once the daemon runs
    TempDir dir;
    auto r = run_process(concat(cohort_run({"-n", "1", "--kill-grace", "2"}),
                                sh(start_daemon(dir) + "kill -INT $PPID; sleep 60")),
                         {}, 60);
    EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.err;
    EXPECT_LT(r.seconds, 10.0) << r.err;
    expect_daemon_gone(dir, 0);
  }
}

// The same under a remote agent (`cohort agent`, reached through the ssh stand-in): the agent is the
// subreaper of its own workers' descendants.
TEST(Run, ARemoteWorkersDaemonEndsWithTheJob) {
  TempDir dir;
  std::string shim = write_shim(dir);
  auto r = run_process(concat(cohort_run({"-H", "hostA:1,hostB:1", "--master-addr", "127.0.0.1", "--ssh-command", shim,
                                          "--kill-grace", "2"}),
                              sh("if [ $RANK = 1 ]; then " + start_daemon(dir) + "fi; exit 0")),
                       {}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(r.seconds, 15.0) << r.err;
  expect_daemon_gone(dir, 1);
}

TEST(Run, WorkerEnvironmentOfEveryWorker) {
  TempDir dir;
  auto r = run_process(concat(cohort_run({"-n", "3", "--no-tag-output"}),
                              sh("echo \"$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $NODE_RANK "
                                 "$MASTER_ADDR $MASTER_PORT $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS "
                                 "$TORCHELASTIC_RUN_ID $COHORT_STORE_ADDR $COHORT_JOB_ID ${#COHORT_JOB_TOKEN} "
                                 "$OMP_NUM_THREADS\" > " +
                                 dir.path() + "/env.$RANK")),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::set<std::string> store_addrs;
  for (int rank = 0; rank < 3; ++rank) {
    std::istringstream in(read_file(dir.file("env." + std::to_string(rank))));
    std::string rk, lr, ws, lws, gr, nr, ma, mp, rc, mr, run_id, store, job, token_len, omp;
    in >> rk >> lr >> ws >> lws >> gr >> nr >> ma >> mp >> rc >> mr >> run_id >> store >> job >> token_len >> omp;
    EXPECT_EQ(rk, std::to_string(rank));
    EXPECT_EQ(lr, std::to_string(rank));
    EXPECT_EQ(ws, "3");
    EXPECT_EQ(lws, "3");
    EXPECT_EQ(gr, "0");
    EXPECT_EQ(nr, "0");
    EXPECT_EQ(ma, "127.0.0.1");
    EXPECT_NE(store, "127.0.0.1:" + mp) << "torch's MASTER_PORT must differ from the cohort store's port";
    EXPECT_EQ(rc, "0");
    EXPECT_EQ(mr, "0");
    EXPECT_EQ(run_id, job);
    EXPECT_EQ(token_len, "64");
    EXPECT_EQ(omp, "1");
    store_addrs.insert(store);
  }
  EXPECT_EQ(store_addrs.size(), 1u);
  EXPECT_NE(r.err.find("OMP_NUM_THREADS=1"), std::string::npos) << r.err;
}

// The OMP_NUM_THREADS note is said once per job: by node 0's launcher, not by every node's.
TEST(Run, TheOmpNoteIsPrintedOncePerJob) {
  const auto [first, second] = two_nodes_on_loopback(free_port(), "[ \"$OMP_NUM_THREADS\" = 1 ]");
  ASSERT_EQ(first.exit_code, 0) << first.err;  // every worker of both nodes had OMP_NUM_THREADS=1
  ASSERT_EQ(second.exit_code, 0) << second.err;
  auto notes = [](const std::string& err) {
    size_t n = 0;
    for (size_t at = err.find("setting OMP_NUM_THREADS=1"); at != std::string::npos;
         at = err.find("setting OMP_NUM_THREADS=1", at + 1))
      ++n;
    return n;
  };
  EXPECT_EQ(notes(first.err), 1u) << first.err;
  EXPECT_EQ(notes(second.err), 0u) << second.err;
}

TEST(Run, BindToCoreAndDevicePerRank) {
  auto r = run_process(concat(cohort_run({"-n", "2", "--bind-to", "core", "--device-per-rank", "--no-tag-output"}),
                              sh("echo \"$RANK $CUDA_VISIBLE_DEVICES $(grep Cpus_allowed_list /proc/self/status | "
                                 "cut -f2)\"")),
                       {"CUDA_VISIBLE_DEVICES=", "ASCEND_RT_VISIBLE_DEVICES="}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // This test runs with whatever CPUs it may use; rank i gets the i-th of them (wrapping).
  auto dry = run_process(concat(cohort_run({"--dry-run", "-n", "2", "--bind-to", "core"}), sh("true")), {}, 30);
  std::smatch m0, m1;
  ASSERT_TRUE(std::regex_search(dry.out, m0, std::regex(R"(rank 0 \(local 0\) cpus (\d+):)"))) << dry.out;
  ASSERT_TRUE(std::regex_search(dry.out, m1, std::regex(R"(rank 1 \(local 1\) cpus (\d+):)"))) << dry.out;
  EXPECT_NE(r.out.find("0 0 " + m0[1].str() + "\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 1 " + m1[1].str() + "\n"), std::string::npos) << r.out;
}

// Every worker leads a session of its own (and so a process group of its own). Where the scheduler
// groups tasks by session (autogroup), that is what lets each rank compete for its CPU as an
// independent process does, instead of the ranks splitting one session's weight between them
// (docs/launcher.md, "Supervision"). Checked on the kernel's own record: /proc/PID/stat's session
// field, and /proc/PID/autogroup where the kernel has autogroups.
TEST(Run, EveryWorkerLeadsASessionOfItsOwn) {
  auto r = run_process(concat(cohort_run({"-n", "2", "--no-tag-output"}),
                              sh("echo \"rank $RANK pid $$ session $(cut -d' ' -f6 /proc/$$/stat) autogroup "
                                 "$(cut -d' ' -f1 /proc/$$/autogroup 2>/dev/null || echo none)\"")),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::regex line(R"(rank (\d) pid (\d+) session (\d+) autogroup (\S+)\n)");
  std::set<std::string> autogroups;
  int workers = 0;
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), line); it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    EXPECT_EQ(m[2].str(), m[3].str()) << "rank " << m[1] << " is not its session's leader: " << r.out;
    EXPECT_NE(std::stol(m[3].str()), static_cast<long>(getsid(0))) << "rank " << m[1] << " is in the test's session";
    autogroups.insert(m[4].str());
    ++workers;
  }
  ASSERT_EQ(workers, 2) << r.out;
  if (!autogroups.count("none")) {
    EXPECT_EQ(autogroups.size(), 2u) << "the ranks share an autogroup: " << r.out;
  }
}

TEST(Run, OutputIsTaggedAndFilteredByRank) {
  auto r = run_process(concat(cohort_run({"-n", "3", "--ranks-to-console", "1-2"}),
                              sh("echo out$RANK; echo err$RANK >&2")),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("out0"), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(\[[^:\]]+:1\] out1\n)"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.err, std::regex(R"(\[[^:\]]+:2\] err2\n)"))) << r.err;
}

TEST(Run, PerRankFilesAndMerge) {
  TempDir dir;
  auto r = run_process(concat(cohort_run({"-n", "2", "--output-filename", dir.path() + "/logs"}),
                              sh("echo out$RANK; echo err$RANK >&2")),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    std::string base = dir.path() + "/logs/rank." + std::to_string(rank);
    EXPECT_EQ(read_file(base + "/stdout"), "out" + std::to_string(rank) + "\n");
    EXPECT_EQ(read_file(base + "/stderr"), "err" + std::to_string(rank) + "\n");
  }
  EXPECT_NE(r.out.find("out1"), std::string::npos);  // the console still gets every rank by default
  auto m = run_process(concat(cohort_run({"-n", "1", "--output-filename", dir.path() + "/merged",
                                          "--merge-stderr-to-stdout", "--ranks-to-console", "none"}),
                              sh("echo a; echo b >&2; echo c")),
                       {}, 30);
  ASSERT_EQ(m.exit_code, 0) << m.err;
  EXPECT_EQ(read_file(dir.path() + "/merged/rank.0/stdout"), "a\nb\nc\n");
  struct stat st {};
  EXPECT_NE(stat((dir.path() + "/merged/rank.0/stderr").c_str(), &st), 0);
  EXPECT_EQ(m.out, "");
}

// A store address that does not resolve on the store's own host (a fresh root without its host name in
// /etc/hosts) is one line at once, not workers retrying in silence until the store's deadline.
TEST(Run, AStoreAddressThatDoesNotResolveIsOneLineAtOnce) {
  auto r = run_process(concat(cohort_run({"-H", "localhost:1", "--master-addr", "no-such-host.invalid"}),
                              std::vector<std::string>{"/bin/true"}),
                       {}, 30);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_NE(r.err.find("the job's store address 'no-such-host.invalid' (--master-addr) does not resolve on this host"),
            std::string::npos)
      << r.err;
}

TEST(Run, FailFastReturnsTheWorkersCodeWithinTwoSeconds) {
  TempDir dir;
  auto r = run_process(concat(cohort_run({"-n", "4"}),
                              sh("echo $$ > " + dir.path() + "/pid.$RANK; "
                                 "if [ $RANK = 2 ]; then echo 'disk full' >&2; exit 3; fi; exec sleep 60")),
                       {}, 30);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_LT(r.seconds, 2.0);
  // One summary naming the build, then rank, host, pid, code, run time and the last stderr lines.
  EXPECT_TRUE(std::regex_search(r.err, std::regex(R"(job failed \(exit 3\): rank 2 on \S+ \(pid \d+\) exited with code 3 after [0-9.]+ s; last lines of its stderr:\n +\| disk full)")))
      << r.err;
  EXPECT_NE(r.err.find("cohort run " + build::version_text() + ": job failed (exit 3): rank 2"), std::string::npos)
      << r.err;
  expect_no_process_left(dir, 4);
}

// `cohort run -n 3` of a shell script in which $GONE names a marker file, absent at the start, that
// one rank creates when it is about to fail (the others wait for it to act after that failure).
auto run_three_with_marker(const std::string& script) {
  TempDir dir;
  return run_process(concat(cohort_run({"-n", "3"}), sh("GONE=" + dir.path() + "/gone; " + script)), {}, 30);
}

TEST(Run, SurvivorsGetAReportWindowBeforeTheStopSignal) {
  // After a failure the others get up to 1 s to fail on their own before SIGTERM: a communicator sees
  // a lost peer within milliseconds and names it, and that line must not be lost to the signal.
  auto r = run_three_with_marker(
      "if [ $RANK = 2 ]; then touch $GONE; exit 3; fi; "
      "while [ ! -e $GONE ]; do sleep 0.01; done; sleep 0.2; "
      "echo \"rank $RANK: lost rank 2\" >&2; exit 1");
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("rank 0: lost rank 2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 1: lost rank 2"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 2.0);
}

TEST(Run, AKilledWorkerIsTheRootCauseEvenWhenItsPeersErrorsArriveFirst) {
  // Rank 0 reports losing rank 1 and exits before rank 1's SIGKILL is reaped (as a communicator
  // does when its peer's connection closes). The summary and exit code name the kill, not the report.
  auto r = run_three_with_marker(
      "if [ $RANK = 1 ]; then touch $GONE; sleep 0.1; kill -9 $$; fi; "
      "if [ $RANK = 0 ]; then while [ ! -e $GONE ]; do sleep 0.01; done; "
      "echo 'allreduce #7 on rank 0 (vm): lost rank 1 (vm): connection closed' >&2; exit 1; fi; "
      "exec sleep 60");
  EXPECT_EQ(r.exit_code, 128 + 9) << r.err;
  EXPECT_TRUE(std::regex_search(r.err, std::regex(R"(job failed \(exit 137\): rank 1 on \S+ \(pid \d+\) was killed by SIGKILL)")))
      << r.err;
  EXPECT_LT(r.seconds, 3.0);
}

TEST(Run, WorkersIgnoringSigtermAreKilledAfterTheGrace) {
  TempDir dir;
  auto r = run_process(concat(cohort_run({"-n", "2", "--kill-grace", "0.3"}),
                              sh("echo $$ > " + dir.path() + "/pid.$RANK; trap '' TERM; "
                                 "if [ $RANK = 1 ]; then sleep 0.2; kill -9 $$; fi; while :; do sleep 0.05; done")),
                       {}, 30);
  EXPECT_EQ(r.exit_code, 128 + 9) << r.err;
  // Rank 1 killed itself: no OOM kill was reported, so memory is not blamed (launch/oom.h).
  EXPECT_NE(r.err.find("was killed by SIGKILL, not sent by cohort run"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  expect_no_process_left(dir, 2);
}

TEST(Run, NoAbortOnFailureLetsOthersFinish) {
  TempDir dir;
  auto r = run_process(concat(cohort_run({"-n", "3", "--no-abort-on-failure"}),
                              sh(launch::rank0_fails_others_outlast_the_report_window(dir))),
                       {}, 30);
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_EQ(read_file(dir.file("done.1")), "done\n");
  EXPECT_EQ(read_file(dir.file("done.2")), "done\n");
}

TEST(Run, RestartsEveryWorkerWithANewRestartCount) {
  TempDir dir;
  auto r = run_process(concat(cohort_run({"-n", "2", "--max-restarts", "3"}),
                              sh("echo $TORCHELASTIC_RESTART_COUNT >> " + dir.path() +
                                 "/attempts.$RANK; if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT -lt 2 ]; then "
                                 "exit 7; fi; exit 0")),
                       {}, 30);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_file(dir.file("attempts.1")), "0\n1\n2\n");
  EXPECT_NE(r.err.find("restarting every worker (restart 2 of 3)"), std::string::npos) << r.err;
  auto exhausted = run_process(concat(cohort_run({"-n", "1", "--max-restarts", "1"}), sh("exit 9")), {}, 30);
  EXPECT_EQ(exhausted.exit_code, 9);
}

TEST(Run, ForwardsSignalsToEveryWorker) {
  TempDir dir;
  // Every worker traps USR1 and TERM; once all are ready, rank 0 signals the launcher (its parent):
  // USR1, then TERM once every worker has written down its USR1. It must wait for that, not for a
  // fixed time: the forwarded USR1 also ends rank 0's own `sleep` (same process group), and a TERM
  // that reaches a shell while it is still running its USR1 trap runs the TERM trap at once, whose
  // `exit` cuts the USR1 trap short (dash does that; seen once in 240 runs under load).
  std::string d = dir.path();
  std::string script =
      "trap 'echo usr1 >> " + d + "/sig.$RANK' USR1; trap 'echo term >> " + d + "/sig.$RANK; exit 0' TERM; "
      "echo $$ > " + d + "/pid.$RANK; touch " + d + "/ready.$RANK; "
      "if [ $RANK = 0 ]; then while [ ! -e " + d + "/ready.1 ] || [ ! -e " + d + "/ready.2 ]; do sleep 0.02; done; "
      "kill -USR1 $PPID; j=0; "
      "while [ $j -lt 250 ] && { [ ! -s " + d + "/sig.0 ] || [ ! -s " + d + "/sig.1 ] || [ ! -s " + d + "/sig.2 ]; }; "
      "do sleep 0.02; j=$((j+1)); done; kill -TERM $PPID; fi; "
      "i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done";
  auto r = run_process(concat(cohort_run({"-n", "3"}), sh(script)), {}, 30);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_EQ(read_file(dir.file("sig." + std::to_string(rank))), "usr1\nterm\n") << "rank " << rank;
  EXPECT_NE(r.err.find("interrupted by SIGTERM"), std::string::npos) << r.err;
  expect_no_process_left(dir, 3);
}

TEST(Run, BadInputIsOneLineAndExit2BeforeAnyWorkerStarts) {
  TempDir dir;
  std::string marker = dir.file("started");
  auto worker = sh("touch " + marker);
  auto check = [&](std::vector<std::string> flags, const std::string& expected) {
    auto r = run_process(concat(cohort_run(flags), worker), {}, 30);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(expected), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  check({"--bogus-flag"}, "--bogus-flag");
  check({"--nproc-per-node", "0"}, "--nproc-per-node 0: expected a positive number or 'auto'");
  check({"--hostfile", dir.file("missing")}, "cannot read");
  write_file(dir.file("hosts"), "a slots=2\nb slots=0\n");
  check({"--hostfile", dir.file("hosts")}, dir.file("hosts") + ":2: slots=0");
  check({"--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"}, "must be below the node count 2");
  auto missing = run_process(cohort_run({"-n", "2", "/no/such/program"}), {}, 30);
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.err.find("program '/no/such/program' does not exist"), std::string::npos) << missing.err;
  write_file(dir.file("bad-interp.sh"), "#!/no/such/interpreter\necho hi\n");
  chmod(dir.file("bad-interp.sh").c_str(), 0755);
  auto interp = run_process(cohort_run({"-n", "2", dir.file("bad-interp.sh")}), {}, 30);
  EXPECT_EQ(interp.exit_code, 2);
  EXPECT_NE(interp.err.find("its interpreter '/no/such/interpreter'"), std::string::npos) << interp.err;
  // A port in use is named, with the advice to leave it unset.
  auto held = net::listen_tcp("127.0.0.1", 0, 1, false);  // a port someone else already uses
  std::string port = std::to_string(net::local_address(held.get()).port());
  check({"--master-port", port}, port);
  auto busy = run_process(concat(cohort_run({"--master-port", port}), worker), {}, 30);
  EXPECT_NE(busy.err.find("leave --master-port"), std::string::npos) << busy.err;
  // The advice once, and where the port came from.
  EXPECT_NE(busy.err.find("(store port from --master-port)"), std::string::npos) << busy.err;
  EXPECT_EQ(busy.err.find("unset"), busy.err.rfind("unset")) << "the same advice twice: " << busy.err;
  // A per-node job's nodes meet at one fixed port (29500 when none is given): leaving it unset is no
  // way out there.
  check({"--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", port},
        "give every node's cohort run the same free port with --master-port PORT");
  auto per_node = run_process(
      concat(cohort_run({"--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", port}),
             worker),
      {}, 30);
  EXPECT_EQ(per_node.err.find("unset"), std::string::npos) << per_node.err;
  struct stat st {};
  EXPECT_NE(stat(marker.c_str(), &st), 0) << "a worker started despite bad input";
}

TEST(Run, AWorkersExitCode2IsSaidToBeTheProgramsOwn) {
  // argparse exits 2 on a bad argument, as cohort run does on its own bad input: the summary says which.
  auto r = run_process(concat(cohort_run({"-n", "2"}), sh("echo 'usage: train.py [-h]' >&2; exit 2")), {}, 30);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("exited with code 2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("exit code 2 is the program's own"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("cohort run's own bad input stops it before any worker starts"), std::string::npos) << r.err;
  // Another code gets no such line.
  auto other = run_process(concat(cohort_run({"-n", "2"}), sh("exit 3")), {}, 30);
  EXPECT_EQ(other.exit_code, 3) << other.err;
  EXPECT_EQ(other.err.find("exit code 2 is"), std::string::npos) << other.err;
}

TEST(Run, DryRunPrintsThePlanAndStartsNothing) {
  TempDir dir;
  auto r = run_process(concat(cohort_run({"--dry-run", "--nproc_per_node", "2", "--bind-to", "core"}),
                              sh("touch " + dir.file("started"))),
                       {{"SLURM_JOB_NODELIST=n[1-2]"}, {"SLURM_NODEID=1"}}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("mode            per-node"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("this node rank  1  [SLURM_NODEID]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("n1:29500  [address: SLURM_JOB_NODELIST (first node)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 3 (local 1) cpus"), std::string::npos) << r.out;
  struct stat st {};
  EXPECT_NE(stat(dir.file("started").c_str(), &st), 0);
}

TEST(Run, ExampleHelloMeetsThroughTheStore) {
  std::string hello = std::string(COHORT_TEST_BIN_DIR) + "/../examples/hello/hello";
  auto r = run_process(cohort_run({"-n", "4", hello, "--store"}), {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("rank 0: all 4 ranks met at the store"), std::string::npos) << r.out;
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(r.out.find("hello from rank " + std::to_string(rank) + " of 4"), std::string::npos) << r.out;
}

TEST(Run, AShellsLeftoverRankVariablesDoNotMakeALocalJobWaitForNodes) {
  // Left in the shell by a DDP script run by hand (issue 46): -n 2 is a job of this machine, with one
  // note naming what it ignored. (Before, a job of 2 nodes that waited 300 s for node 1.)
  std::string hello = std::string(COHORT_TEST_BIN_DIR) + "/../examples/hello/hello";
  const std::string port = std::to_string(free_port());
  auto r = run_process(cohort_run({"-n", "2", hello, "--store"}),
                       {"WORLD_SIZE=2", "RANK=0", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("rank 0: all 2 ranks met at the store"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("cohort run: note: ignoring MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
                       " WORLD_SIZE=2 RANK=0 from the environment: -n 2 without --nnodes is a job on this machine"),
            0u)
      << r.err;
  size_t notes = 0;
  for (size_t at = r.err.find("note: "); at != std::string::npos; at = r.err.find("note: ", at + 1)) ++notes;
  EXPECT_EQ(notes, 1u) << r.err;
}

TEST(Run, TwoNodesPerNodeModeOnLoopback) {
  TempDir dir;
  const int port = free_port();
  const auto [first, second] =
      two_nodes_on_loopback(port, "echo $$ > " + dir.path() + "/pid.$RANK; echo \"$NODE_RANK $WORLD_SIZE "
                                  "$COHORT_STORE_ADDR $MASTER_PORT\" > " + dir.path() + "/env.$RANK");
  EXPECT_EQ(first.exit_code, 0) << first.err;
  EXPECT_EQ(second.exit_code, 0) << second.err;
  std::set<std::string> torch_ports;
  for (int rank = 0; rank < 4; ++rank) {
    std::istringstream in(read_file(dir.file("env." + std::to_string(rank))));
    std::string nr, ws, store, mp;
    in >> nr >> ws >> store >> mp;
    EXPECT_EQ(nr, std::to_string(rank / 2));
    EXPECT_EQ(ws, "4");
    EXPECT_EQ(store, "127.0.0.1:" + std::to_string(port));
    torch_ports.insert(mp);
  }
  EXPECT_EQ(torch_ports.size(), 1u);
  expect_no_process_left(dir, 4);
}

TEST(Run, TwoNodesFailFastAcrossNodes) {
  TempDir dir;
  const auto [first, second] = two_nodes_on_loopback(
      free_port(), "echo $$ > " + dir.path() + "/pid.$RANK; if [ $RANK = 3 ]; then exit 6; fi; exec sleep 60");
  EXPECT_EQ(first.exit_code, 6) << first.err;
  EXPECT_EQ(second.exit_code, 6) << second.err;
  EXPECT_LT(first.seconds, 5.0);
  EXPECT_NE(first.err.find("rank 3"), std::string::npos) << first.err;
  expect_no_process_left(dir, 4);
}

TEST(Run, TwoNodesLosingNodeZeroStopsTheOtherNode) {
  TempDir dir;
  std::string d = dir.path();
  int port = free_port();
  std::string node = "'" + cohort_tool() + "' run --nnodes 2 --master-addr 127.0.0.1 --master-port " +
                     std::to_string(port) + " --node-rank ";
  std::string worker = " /bin/sh -c 'echo $$ > " + d + "/pid.$RANK; exec sleep 60'";
  // Node 0 is SIGKILLed once both workers run; node 1 must notice and stop its worker at once.
  std::string script = node + "0" + worker + " & head=$!; " + node + "1" + worker + " 2> " + d +
                       "/node1.err & other=$!; i=0; while [ $i -lt 200 ] && ! { [ -s " + d + "/pid.0 ] && [ -s " + d +
                       "/pid.1 ]; }; do sleep 0.05; i=$((i+1)); done; kill -9 $head; wait $other";
  auto r = run_process(sh(script), {}, 60);
  EXPECT_EQ(r.exit_code, 1) << read_file(dir.file("node1.err"));
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_NE(read_file(dir.file("node1.err")).find("lost the job's store"), std::string::npos)
      << read_file(dir.file("node1.err"));
  expect_no_process_left(dir, 2);
}

TEST(Run, JoiningNodeSaysWhoIsMissingAndGivesUp) {
  int port = free_port();
  auto r = run_process(concat(cohort_run({"--nnodes", "3", "--node-rank", "0", "--master-addr", "127.0.0.1",
                                          "--master-port", std::to_string(port), "--join-timeout", "4"}),
                              sh("true")),
                       {}, 30);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("waiting for node ranks 1-2 to join"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("node ranks 1-2 did not join within 4 s"), std::string::npos) << r.err;
}

TEST(Run, SshFanOutThroughAShim) {
  TempDir dir;
  std::string shim = write_shim(dir);
  auto r = run_process(concat(cohort_run({"-H", "hostA:2,hostB:1", "--master-addr", "127.0.0.1", "--ssh-command",
                                          shim + " -o BatchMode=yes", "-x", "GREETING=hi"}),
                              sh("echo \"$RANK $WORLD_SIZE $NODE_RANK $LOCAL_RANK $COHORT_HOST_ID $GREETING\"")),
                       {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[hostA:0] 0 3 0 0 hostA hi\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[hostA:1] 1 3 0 1 hostA hi\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[hostB:2] 2 3 1 0 hostB hi\n"), std::string::npos) << r.out;
}

TEST(Run, SshFanOutFailFastAndUnreachableHost) {
  TempDir dir;
  std::string shim = write_shim(dir);
  auto r = run_process(concat(cohort_run({"-H", "hostA:2,hostB:2", "--master-addr", "127.0.0.1", "--ssh-command",
                                          shim}),
                              sh("echo $$ > " + dir.path() + "/pid.$RANK; if [ $RANK = 2 ]; then exit 5; fi; "
                                 "exec sleep 60")),
                       {}, 60);
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_NE(r.err.find("rank 2 on hostB"), std::string::npos) << r.err;
  expect_no_process_left(dir, 4);
  // An ssh command that cannot reach its host ends the job at once, naming the host.
  write_file(dir.file("bad-ssh"), "#!/bin/sh\necho \"ssh: connect to host $1 port 22: Connection refused\" >&2\nexit 255\n");
  chmod(dir.file("bad-ssh").c_str(), 0755);
  auto bad = run_process(concat(cohort_run({"-H", "nowhere:1", "--master-addr", "127.0.0.1", "--ssh-command",
                                            dir.file("bad-ssh")}),
                                sh("true")),
                         {}, 60);
  EXPECT_EQ(bad.exit_code, 255) << bad.err;
  EXPECT_NE(bad.err.find("the agent for host nowhere"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("Connection refused"), std::string::npos) << bad.err;
  EXPECT_LT(bad.seconds, 5.0);
}

TEST(Run, SshFanOutRestartsEveryNode) {
  TempDir dir;
  std::string shim = write_shim(dir);
  auto r = run_process(concat(cohort_run({"-H", "hostA:1,hostB:1", "--master-addr", "127.0.0.1", "--ssh-command", shim,
                                          "--max-restarts", "2"}),
                              sh("echo $TORCHELASTIC_RESTART_COUNT >> " + dir.path() + "/attempts.$RANK; "
                                 // rank 1 fails only once rank 0's first attempt has started, so that attempt is seen
                                 "if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then i=0; "
                                 "while [ ! -s " + dir.path() + "/attempts.0 ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; "
                                 "exit 4; fi; "
                                 "if [ $RANK = 0 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then exec sleep 60; fi")),
                       {}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_file(dir.file("attempts.0")), "0\n1\n");  // rank 0 was stopped and started again
  EXPECT_EQ(read_file(dir.file("attempts.1")), "0\n1\n");
  EXPECT_NE(r.err.find("restarting every worker (restart 1 of 2) after: rank 1 on hostB"), std::string::npos) << r.err;
}

TEST(Run, KilledHeadTakesRemoteAgentsAndWorkersWithIt) {
  TempDir dir;
  std::string shim = write_shim(dir);
  std::string d = dir.path();
  // The head runs in the background; once every worker has written its pid the head is SIGKILLed.
  std::string script = "'" + cohort_tool() + "' run -H hostA:2,hostB:2 --master-addr 127.0.0.1 --ssh-command " +
                       shim + " /bin/sh -c 'echo $$ > " + d + "/pid.$RANK; exec sleep 60' & head=$!; i=0; "
                       "while [ $i -lt 200 ] && ! { [ -s " + d + "/pid.0 ] && [ -s " + d + "/pid.1 ] && [ -s " + d +
                       "/pid.2 ] && [ -s " + d + "/pid.3 ]; }; do sleep 0.05; i=$((i+1)); done; kill -9 $head; wait $head";
  auto r = run_process(sh(script), {}, 60);
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << "the head should have been SIGKILLed: " << r.err;
  for (int rank = 0; rank < 4; ++rank)
    ASSERT_FALSE(read_file(dir.file("pid." + std::to_string(rank))).empty()) << "rank " << rank << " never started";
  expect_no_process_left(dir, 4);
}

// An agent cut off from the head's store (here: the head frozen with SIGSTOP, so its store stops
// answering while the agents' control channels stay open) stops its workers on its own. It must say why
// in one line, which the head quotes once it runs again: without it the head could only say that the
// agent "exited with code 1". Neither host is this one: the head runs an agent for each.
TEST(Run, AnAgentThatLosesTheHeadsStoreSaysSoInOneLine) {
  TempDir dir;
  std::string shim = write_shim(dir);
  std::string d = dir.path();
  // Every wait has a deadline (200 x 0.05 s): the frozen head is woken whatever happened.
  std::string script = "'" + cohort_tool() + "' run -H hostA:1,hostB:1 --master-addr 127.0.0.1 --kill-grace 2 "
                       "--ssh-command " + shim + " /bin/sh -c 'echo $$ > " + d + "/pid.$RANK; exec sleep 60' & "
                       "head=$!; i=0; "
                       "while [ $i -lt 200 ] && ! { [ -s " + d + "/pid.0 ] && [ -s " + d + "/pid.1 ]; }; do "
                       "sleep 0.05; i=$((i+1)); done; kill -STOP $head; i=0; "
                       // both agents stopped their workers: they gave up on the store
                       "while [ $i -lt 200 ] && { kill -0 $(cat " + d + "/pid.0) || kill -0 $(cat " + d +
                       "/pid.1); } 2>/dev/null; do sleep 0.05; i=$((i+1)); done; kill -CONT $head; wait $head";
  auto r = run_process(sh(script), {}, 60);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_TRUE(std::regex_search(r.err, std::regex("the agent for host host[AB] \\(node [01], ranks [01]-[01]\\) "
                                                  "exited with code 1 before the job ended; its last stderr lines:")))
      << r.err;
  // The agent's own line: which store, and how long it went without an answer.
  EXPECT_TRUE(std::regex_search(r.err, std::regex("\\| cohort run: node [01] \\(" + net::hostname() +
                                                  "\\): lost the job's store at 127\\.0\\.0\\.1:[0-9]+ \\(its host, "
                                                  "the head launcher, is gone\\?\\): [0-9.]+ s without an answer")))
      << r.err;
  EXPECT_LT(r.seconds, 15.0) << r.err;
  expect_no_process_left(dir, 2);
}

// A GPU job on a machine whose `nvidia-smi -L` is a fake on PATH (this machine has no GPU): the
// plan takes one rank per GPU, each worker learns its device, and a rank too many is refused.
TEST(Run, GpuJobWithFakeNvidiaSmi) {
  TempDir dir;
  write_file(dir.file("nvidia-smi"),
             "#!/bin/sh\n[ \"$1\" = -L ] || exit 9\n"
             "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa0000-0000-0000-0000-000000000000)'\n"
             "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb0000-0000-0000-0000-000000000000)'\n");
  chmod(dir.file("nvidia-smi").c_str(), 0755);
  const char* path = getenv("PATH");
  std::vector<std::string> env = {"PATH=" + dir.path() + ":" + (path ? path : "/usr/bin:/bin")};

  auto dry = run_process(concat(cohort_run({"--dry-run", "--gpus-per-node", "auto"}), {"/bin/true"}), env, 30);
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_NE(dry.out.find("gpus per node   2, one per rank  [--gpus-per-node auto (nvidia-smi -L)]"), std::string::npos)
      << dry.out;
  EXPECT_NE(dry.out.find("rank 1 (local 1) GPU 1 (NVIDIA H100 80GB HBM3),"), std::string::npos) << dry.out;

  auto r = run_process(concat(cohort_run({"--gpus-per-node", "auto", "--no-tag-output"}),
                              sh("echo \"$LOCAL_RANK $COHORT_LOCAL_GPU $COHORT_GPUS_PER_NODE ${CUDA_VISIBLE_DEVICES-unset}\" > " +
                                 dir.path() + "/gpu.$RANK")),
                       env, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_file(dir.file("gpu.0")), "0 0 2 unset\n");
  EXPECT_EQ(read_file(dir.file("gpu.1")), "1 1 2 unset\n");

  auto narrowed = run_process(concat(cohort_run({"--gpus-per-node", "2", "--device-per-rank", "--no-tag-output"}),
                                     sh("echo \"$COHORT_LOCAL_GPU $CUDA_VISIBLE_DEVICES\" > " + dir.path() + "/n.$RANK")),
                              env, 30);
  ASSERT_EQ(narrowed.exit_code, 0) << narrowed.err;
  EXPECT_EQ(read_file(dir.file("n.1")), "0 1\n");

  auto too_many = run_process(concat(cohort_run({"--gpus-per-node", "auto", "-n", "3"}), {"/bin/true"}), env, 30);
  EXPECT_EQ(too_many.exit_code, 2);
  EXPECT_NE(too_many.err.find("3 local ranks on"), std::string::npos) << too_many.err;
  EXPECT_NE(too_many.err.find("--gpu-share"), std::string::npos) << too_many.err;

  // No nvidia-smi and no driver: one line saying what was looked at.
  auto none = run_process(concat(cohort_run({"--gpus-per-node", "auto"}), {"/bin/true"}),
                          {"PATH=/nonexistent-dir"}, 30);
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.err.find("--gpus-per-node auto: no GPU on"), std::string::npos) << none.err;
}

}  // namespace
}  // namespace cohort::test
