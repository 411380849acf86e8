// The mpirun command lines people type, under the real `cohort run`: -mca settings (the interface
// selections mapped to cohort's, the rest ignored with one note), --oversubscribe beyond the hosts'
// slots, --timeout (the job's wall-clock limit on every node), --wdir, --timestamp-output, --rank-by and
// --map-by node (ranks dealt over the hosts of a fan-out),
// and a --help that shows one usage line and lists the mpirun flags taken.
#include <sys/stat.h>

#include <chrono>
#include <regex>
#include <thread>

#include <gtest/gtest.h>

#include "launch_test_util.h"
#include "support/cohort_run.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The workers wrote their pids to dir/pid.N: none may outlive the job (a short grace for the kernel to
// deliver the last SIGKILLs).
void expect_no_process_left(const TempDir& dir, int n) {
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  for (int r = 0; r < n; ++r) {
    std::string text = read_file(dir.file("pid." + std::to_string(r)));
    ASSERT_FALSE(text.empty()) << "rank " << r << " never started";
    int pid = std::stoi(text);
    while (process_alive(pid) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(process_alive(pid)) << "rank " << r << " (pid " << pid << ") outlived the job";
  }
}

// A worker that writes its pid, then waits for the job to end it. `ignore_term`: it ignores SIGTERM, so
// only the SIGKILL after --kill-grace ends it.
std::string waiting_worker(const TempDir& dir, bool ignore_term = false) {
  return std::string(ignore_term ? "trap '' TERM; " : "") + "echo $$ > " + dir.path() +
         "/pid.$RANK.tmp && mv " + dir.path() + "/pid.$RANK.tmp " + dir.path() + "/pid.$RANK; exec sleep 60";
}

TEST(MpirunLines, McaSettingsAreTakenTheInterfacesMappedAndTheRestNotedOnce) {
  // A real mpirun line: component choices are ignored with one note, the TCP interface selection becomes
  // COHORT_TCP_IFNAME for every worker.
  auto r = run_process(with_sh(cohort_run({"-mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo", "-mca",
                                           "plm_rsh_agent", "ssh", "-np", "2", "--no-tag-output"}),
                               "echo \"ifname=$COHORT_TCP_IFNAME\""),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "ifname=lo\nifname=lo\n");
  EXPECT_EQ(count_of(r.err, "note:"), 1u) << r.err;
  EXPECT_NE(r.err.find(
            "cohort run: note: -mca btl self,tcp, -mca plm_rsh_agent ssh: Open MPI's settings, which mean nothing to "
            "cohort (it picks shared memory on a host and TCP between hosts itself; btl_tcp_if_include and "
            "oob_tcp_if_include choose its interfaces, the latter only for a -H/--hostfile job without "
            "--master-addr); ignored\n"), std::string::npos)
      << r.err;
  // The TCP transport takes its addresses from those interfaces: an interface this host lacks fails the
  // ranks with one line naming it, loopback works.
  auto bench = [](const std::string& ifname) {
    return run_process(cohort_run({"-n", "2", "-x", "COHORT_TRANSPORT=tcp", "-mca", "btl_tcp_if_include", ifname,
                                   cohort_tool(), "bench", "allreduce", "-b", "8", "-e", "8", "-n", "1", "-w", "0",
                                   "--trials", "1"}),
                       {}, 60);
  };
  auto bad = bench("nosuchif0");
  EXPECT_NE(bad.exit_code, 0) << bad.err;
  EXPECT_NE(bad.err.find("COHORT_TCP_IFNAME=nosuchif0: no interface of this host"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("its IPv4 interfaces: lo 127.0.0.1"), std::string::npos) << bad.err;
  auto good = bench("lo,127.0.0.0/8");
  EXPECT_EQ(good.exit_code, 0) << good.err;
  // In a fan-out, oob_tcp_if_include places the job's store on this host's address on those interfaces.
  auto dry = run_process(with_sh(cohort_run({"--dry-run", "-H", "localhost:2", "-mca", "oob_tcp_if_include", "lo"}),
                                 "true"),
                         {}, 30);
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_NE(dry.out.find("  store           127.0.0.1:<port chosen by the OS at start>  [address: -mca "
                         "oob_tcp_if_include lo;"),
            std::string::npos)
      << dry.out;
  expect_refused(with_sh(cohort_run({"-mca", "btl_tcp_if_include", "lo", "-x", "COHORT_TCP_IFNAME=eth0"}), "true"),
                 "cohort run: -mca btl_tcp_if_include lo and -x COHORT_TCP_IFNAME=eth0 both given; use one");
}

TEST(MpirunLines, OversubscribePlacesMoreProcessesThanSlots) {
  auto r = run_process(with_sh(cohort_run({"-np", "4", "-H", "localhost:2", "--oversubscribe", "--no-tag-output"}),
                               "echo \"rank $RANK of $WORLD_SIZE\""),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(r.out.find("rank " + std::to_string(rank) + " of 4\n"), std::string::npos) << r.out;
  // Over several hosts the processes beyond the slots are dealt evenly, the first hosts taking the odd one;
  // each host's ranks stay consecutive (Open MPI's by-slot mapping).
  auto dry = run_process(with_sh(cohort_run({"--dry-run", "-n", "9", "-H", "a:2,b:1,c:2", "--oversubscribe"}), "true"),
                         {}, 30);
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_NE(dry.out.find("world size      9  [-n, --oversubscribe: 4 more than the 5 slots]"), std::string::npos)
      << dry.out;
  EXPECT_NE(dry.out.find("\nnode 0 (a, over ssh): ranks 0-3\n"), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("\nnode 1 (b, over ssh): ranks 4-5\n"), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("\nnode 2 (c, over ssh): ranks 6-8\n"), std::string::npos) << dry.out;
  expect_refused(with_sh(cohort_run({"-np", "4", "-H", "localhost:2"}), "true"),
                 "cohort run: -n 4 is more than the 2 slots of -H localhost:2 (--oversubscribe places the rest on the "
                 "same hosts)");
}

TEST(MpirunLines, TimeoutEndsTheJobAtItsWallClockLimit) {
  TempDir dir;
  // Rank 0 ignores SIGTERM: the limit stops the job as any stop does, SIGKILL after --kill-grace.
  auto r = run_process(with_sh(cohort_run({"-np", "2", "-timeout", "1", "--kill-grace", "0.5"}),
                               "if [ $RANK = 0 ]; then trap '' TERM; fi; " + waiting_worker(dir)),
                       {}, 30);
  EXPECT_EQ(r.exit_code, 124) << r.err;
  EXPECT_NE(r.err.find("job stopped (exit 124): the wall-clock limit of 1 s (--timeout) was reached; every worker "
                       "was stopped\n"),
            std::string::npos)
      << r.err;
  EXPECT_GE(r.seconds, 1.0);
  EXPECT_LT(r.seconds, 6.0);
  expect_no_process_left(dir, 2);
  // Open MPI's variable says the same; a limit that is no limit is refused.
  auto dry = run_process(with_sh(cohort_run({"--dry-run", "-n", "1"}), "true"), {"MPIEXEC_TIMEOUT=90"}, 30);
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_NE(dry.out.find("  time limit      90 s, then the job is stopped  [MPIEXEC_TIMEOUT]\n"), std::string::npos)
      << dry.out;
  expect_refused(with_sh(cohort_run({"--timeout", "0"}), "true"),
                 "cohort run: --timeout 0: expected a wall-clock limit in seconds > 0");
}

TEST(MpirunLines, TimeoutEndsEveryNodeOfAFanOut) {
  TempDir dir;
  std::string shim = write_shim(dir);
  auto r = run_process(with_sh(cohort_run({"-H", "hostA:1,hostB:1", "--master-addr", "127.0.0.1", "--ssh-command",
                                           shim, "--timeout", "1", "--kill-grace", "0.5"}),
                               waiting_worker(dir)),
                       {}, 30);
  EXPECT_EQ(r.exit_code, 124) << r.err;
  EXPECT_NE(r.err.find("the wall-clock limit of 1 s (--timeout) was reached"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 8.0);
  expect_no_process_left(dir, 2);
}

TEST(MpirunLines, TimeoutOfOneNodeEndsAPerNodeJob) {
  // torchrun style: only node 1's launcher has a limit; node 0 ends with it, through the job's store.
  TempDir dir;
  int port = free_port();
  auto node = [&](int rank, std::vector<std::string> extra) {
    std::vector<std::string> args = {"--nnodes", "2", "--node-rank", std::to_string(rank), "--master-addr",
                                     "127.0.0.1", "--master-port", std::to_string(port), "--kill-grace", "0.5",
                                     "--join-timeout", "10"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_process(with_sh(cohort_run(args), waiting_worker(dir)), {}, 30);
  };
  ProcessResult r0;
  std::thread t([&] { r0 = node(0, {}); });
  auto r1 = node(1, {"--timeout", "2"});
  t.join();
  EXPECT_EQ(r1.exit_code, 124) << r1.err;
  EXPECT_EQ(r0.exit_code, 124) << r0.err;
  EXPECT_NE(r0.err.find("the wall-clock limit of 2 s (--timeout) was reached"), std::string::npos) << r0.err;
  expect_no_process_left(dir, 2);
}

TEST(MpirunLines, WdirIsTheWorkersFolder) {
  TempDir dir;
  mkdir(dir.file("work").c_str(), 0755);
  write_file(dir.file("work/prog.sh"), "#!/bin/sh\necho \"$RANK in $(pwd)\"\n");
  chmod(dir.file("work/prog.sh").c_str(), 0755);
  // PROGRAM is found where the workers run, as mpirun -wdir does.
  auto r = run_process(cohort_run({"-n", "2", "-wdir", dir.file("work"), "--no-tag-output", "./prog.sh"}), {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("0 in " + dir.file("work") + "\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 in " + dir.file("work") + "\n"), std::string::npos) << r.out;
  // A fan-out's agents run their workers there too.
  std::string shim = write_shim(dir);
  auto fan = run_process(cohort_run({"-H", "hostA:1", "--master-addr", "127.0.0.1", "--ssh-command", shim, "-wd",
                                     dir.file("work"), "./prog.sh"}),
                         {}, 30);
  ASSERT_EQ(fan.exit_code, 0) << fan.err;
  EXPECT_EQ(fan.out, "0 in " + dir.file("work") + "\n");
  expect_refused(with_sh(cohort_run({"--wdir", dir.file("missing")}), "true"),
                 "cohort run: --wdir " + dir.file("missing") + ": cannot enter it: No such file or directory");
}

TEST(MpirunLines, TimestampOutputStampsEveryLine) {
  auto r = run_process(with_sh(cohort_run({"-np", "2", "--timestamp-output"}), "echo out$RANK; echo err$RANK >&2"),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string stamp = R"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} )";
  for (int rank = 0; rank < 2; ++rank) {
    const std::string n = std::to_string(rank);
    EXPECT_TRUE(std::regex_search(r.out, std::regex("(^|\n)" + stamp + R"(\[[^\]]+:)" + n + "\\] out" + n + "\n")))
        << r.out;
    EXPECT_TRUE(std::regex_search(r.err, std::regex("(^|\n)" + stamp + R"(\[[^\]]+:)" + n + "\\] err" + n + "\n")))
        << r.err;
  }
  // One worker, untagged: the stamp alone.
  auto one = run_process(with_sh(cohort_run({"--timestamp-output"}), "echo hi"), {}, 30);
  ASSERT_EQ(one.exit_code, 0) << one.err;
  EXPECT_TRUE(std::regex_match(one.out, std::regex(stamp + "hi\n"))) << one.out;
}

TEST(MpirunLines, RankBySlotIsTheOrderCohortNumbersIn) {
  auto r = run_process(with_sh(cohort_run({"-np", "2", "--rank-by", "slot", "--no-tag-output"}), "echo $RANK"), {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_of(r.out, "\n"), 2u) << r.out;
  expect_refused(with_sh(cohort_run({"--rank-by", "core"}), "true"),
                 "cohort run: --rank-by core: cohort numbers ranks by slot (each host's processes in turn) or by node "
                 "(round robin over the hosts); supported: slot, node");
}

// A fan-out whose ranks are dealt over the hosts: the head's own host (localhost) and others reached
// through the ssh stand-in (COHORT_HOST_ID tells the communicator they are other hosts). Each worker
// says what it was given; then `cohort bench allreduce --check` sums rank-dependent values over the job
// (#wrong 0), its ranks grouped by the host they run on, not by number.
TEST(MpirunLines, MapByNodeAndRankByNodeDealRanksOverTheHostsAndTheirAllreduceAddsUp) {
  TempDir dir;
  std::string shim = write_shim(dir);
  const std::string worker = "echo \"who $RANK $LOCAL_RANK $LOCAL_WORLD_SIZE $NODE_RANK ${COHORT_HOST_ID:-head}\"; exec '" +
                             cohort_tool() + "' bench allreduce -b 4K -e 64K -n 2 -w 1 --check";
  auto job = [&](std::vector<std::string> placement, const std::string& level) {
    auto argv = cohort_run({"--master-addr", "127.0.0.1", "--ssh-command", shim, "-x", "COHORT_LOG_LEVEL=" + level});
    argv.insert(argv.end(), placement.begin(), placement.end());
    auto r = run_process(with_sh(argv, worker), {}, 60);
    r.out += r.err;  // the communicators' log lines come on stderr
    return r;
  };
  // "[host:rank] cohort[rank R] info: communicator '<job's>' ready: rank R of W, H host(s), local rank L of N"
  auto ready = [](const std::string& tag, int rank, int world, int hosts, int local, int local_world) {
    return std::regex(R"(\[)" + tag + ":" + std::to_string(rank) + R"(\] cohort\[rank \d+\] info: communicator '[^']*/comm' ready: rank )" +
                      std::to_string(rank) + " of " + std::to_string(world) + ", " + std::to_string(hosts) +
                      R"( host\(s\), local rank )" + std::to_string(local) + " of " + std::to_string(local_world) + ",");
  };

  // mpirun -np 4 -H a:2,b:2 --map-by node: ranks 0 and 2 here, 1 and 3 on hostB. Every host has two ranks,
  // so the allreduce is the hierarchical one: shared memory inside each host, a TCP ring per local rank.
  auto even = job({"-np", "4", "-H", "localhost:2,hostB:2", "--map-by", "node"}, "debug");
  ASSERT_EQ(even.exit_code, 0) << even.out;
  EXPECT_NE(even.out.find("[localhost:0] who 0 0 2 0 head\n"), std::string::npos) << even.out;
  EXPECT_NE(even.out.find("[localhost:2] who 2 1 2 0 head\n"), std::string::npos) << even.out;
  EXPECT_NE(even.out.find("[hostB:1] who 1 0 2 1 hostB\n"), std::string::npos) << even.out;
  EXPECT_NE(even.out.find("[hostB:3] who 3 1 2 1 hostB\n"), std::string::npos) << even.out;
  EXPECT_TRUE(std::regex_search(even.out, ready("localhost", 0, 4, 2, 0, 2))) << even.out;
  EXPECT_TRUE(std::regex_search(even.out, ready("localhost", 2, 4, 2, 1, 2))) << even.out;
  EXPECT_TRUE(std::regex_search(even.out, ready("hostB", 1, 4, 2, 0, 2))) << even.out;
  EXPECT_TRUE(std::regex_search(even.out, ready("hostB", 3, 4, 2, 1, 2))) << even.out;
  EXPECT_EQ(count_of(even.out, "/comm': 2 hosts x 2 ranks, hierarchical allreduce (shm inside hosts, 2 rings across)"), 4u)
      << even.out;
  EXPECT_NE(even.out.find("[localhost:0] # Out of bounds values : 0 OK"), std::string::npos) << even.out;

  // --rank-by node alone, uneven: placed by slot (3 here, 1 on hostB, 1 on hostC), numbered round robin.
  auto uneven = job({"-np", "5", "-H", "localhost:3,hostB:1,hostC:2", "--rank-by", "node"}, "info");
  ASSERT_EQ(uneven.exit_code, 0) << uneven.out;
  EXPECT_NE(uneven.out.find("[localhost:0] who 0 0 3 0 head\n"), std::string::npos) << uneven.out;
  EXPECT_NE(uneven.out.find("[hostB:1] who 1 0 1 1 hostB\n"), std::string::npos) << uneven.out;
  EXPECT_NE(uneven.out.find("[hostC:2] who 2 0 1 2 hostC\n"), std::string::npos) << uneven.out;
  EXPECT_NE(uneven.out.find("[localhost:3] who 3 1 3 0 head\n"), std::string::npos) << uneven.out;
  EXPECT_NE(uneven.out.find("[localhost:4] who 4 2 3 0 head\n"), std::string::npos) << uneven.out;
  EXPECT_TRUE(std::regex_search(uneven.out, ready("localhost", 3, 5, 3, 1, 3))) << uneven.out;
  EXPECT_TRUE(std::regex_search(uneven.out, ready("localhost", 4, 5, 3, 2, 3))) << uneven.out;
  EXPECT_TRUE(std::regex_search(uneven.out, ready("hostC", 2, 5, 3, 0, 1))) << uneven.out;
  EXPECT_NE(uneven.out.find("[localhost:0] # Out of bounds values : 0 OK"), std::string::npos) << uneven.out;

  // An agent that fails names its host's dealt ranks.
  write_file(dir.file("bad-ssh"), "#!/bin/sh\necho \"ssh: connect to host $1 port 22: Connection refused\" >&2\nexit 255\n");
  chmod(dir.file("bad-ssh").c_str(), 0755);
  auto bad = run_process(with_sh(cohort_run({"-np", "4", "-H", "hostA:2,hostB:2", "--map-by", "node", "--master-addr",
                                             "127.0.0.1", "--ssh-command", dir.file("bad-ssh")}),
                                 "true"),
                         {}, 30);
  EXPECT_EQ(bad.exit_code, 255) << bad.err;
  EXPECT_TRUE(std::regex_search(bad.err, std::regex(R"(the agent for host (hostA \(node 0, ranks 0,2\)|hostB \(node 1, ranks 1,3\)) exited)")))
      << bad.err;
}

TEST(MpirunLines, HelpHasOneUsageLineAndListsTheMpirunFlags) {
  auto r = run_process({cohort_tool(), "run", "--help"}, {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_of(r.out, "sage:"), 1u) << r.out;
  EXPECT_NE(r.out.find("\nUsage: cohort run [OPTIONS] PROGRAM [ARGS...]\n"), std::string::npos) << r.out;
  auto at = r.out.find("\nmpirun's flags:\n");
  ASSERT_NE(at, std::string::npos) << r.out;
  std::string group = r.out.substr(at, r.out.find("\n\n", at + 1) - at);
  for (const char* flag : {"-n,", "-H ", "--hostfile", "-x ", "-N,", "--map-by", "--rank-by", "--bind-to",
                           "--report-bindings", "--tag-output", "--output-filename", "--merge-stderr-to-stdout",
                           "--timestamp-output", "--timeout", "--wdir", "--allow-run-as-root", "--oversubscribe",
                           "--mca KEY VALUE"})
    EXPECT_NE(group.find(flag), std::string::npos) << flag << " is not listed among mpirun's flags:\n" << group;
}

}  // namespace
}  // namespace cohort::test
