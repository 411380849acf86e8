// mpirun's and torchrun's common flags under the real `cohort run` (-N/--npernode, --map-by,
// --report-bindings, --allow-run-as-root, --oversubscribe, --log-dir/--redirects/--tee,
// --local-ranks-filter, --monitor-interval), and the one-line messages of a bad command line for
// every `cohort` command (the flag as typed, what was expected, "did you mean").
#include <sys/stat.h>

#include <regex>

#include <gtest/gtest.h>

#include "launch_test_util.h"
#include "support/cohort_run.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

size_t lines_of(const std::string& text) { return static_cast<size_t>(std::count(text.begin(), text.end(), '\n')); }

bool exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

TEST(MpirunFlags, NpernodeAndPprMapGiveProcessesPerNode) {
  auto r = run_process(with_sh(cohort_run({"-N", "2", "--no-tag-output"}), "echo \"$RANK of $LOCAL_WORLD_SIZE\""), {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("0 of 2\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 of 2\n"), std::string::npos) << r.out;
  // mpirun's other spellings, and where the count came from.
  for (auto flags : std::vector<std::vector<std::string>>{{"--npernode", "3"}, {"-npernode", "3"}}) {
    flags.insert(flags.begin(), "--dry-run");
    auto dry = run_process(with_sh(cohort_run(flags), "true"), {}, 30);
    ASSERT_EQ(dry.exit_code, 0) << dry.err;
    EXPECT_NE(dry.out.find("nproc per node  3  [-N/--npernode]"), std::string::npos) << dry.out;
  }
  auto ppr = run_process(with_sh(cohort_run({"--dry-run", "--map-by", "ppr:2:node"}), "true"), {}, 30);
  ASSERT_EQ(ppr.exit_code, 0) << ppr.err;
  EXPECT_NE(ppr.out.find("nproc per node  2  [--map-by ppr:2:node]"), std::string::npos) << ppr.out;
  // With hosts it replaces each host's slots, as mpirun's -N does.
  auto hosts = run_process(with_sh(cohort_run({"--dry-run", "-H", "a:4,b:4", "-N", "1"}), "true"), {}, 30);
  ASSERT_EQ(hosts.exit_code, 0) << hosts.err;
  EXPECT_NE(hosts.out.find("world size      2  [sum of slots]"), std::string::npos) << hosts.out;
  expect_refused(with_sh(cohort_run({"-N", "2", "--nproc-per-node", "3"}), "true"),
                 "cohort run: --nproc-per-node 3 and -N/--npernode 2 both given; use one");
  expect_refused(with_sh(cohort_run({"-N", "0"}), "true"),
                 "cohort run: -N/--npernode 0: expected a positive number or 'auto'");
}

TEST(MpirunFlags, MapByTakesTheFormsCohortCanDoAndRefusesTheRest) {
  auto bind_of = [](std::vector<std::string> flags) {
    flags.insert(flags.begin(), {"--dry-run", "-n", "2"});
    auto r = run_process(with_sh(cohort_run(flags), "true"), {}, 30);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    std::smatch m;
    return std::regex_search(r.out, m, std::regex(R"(\n  bind-to         (\w+))")) ? m[1].str() : r.out;
  };
  EXPECT_EQ(bind_of({"--map-by", "core"}), "core");
  EXPECT_EQ(bind_of({"--map-by", "socket"}), "numa");
  EXPECT_EQ(bind_of({"--map-by", "numa"}), "numa");
  EXPECT_EQ(bind_of({"--map-by", "slot"}), "auto");
  EXPECT_EQ(bind_of({"-map-by", "core", "-bind-to", "none"}), "none");  // --bind-to wins, as in mpirun
  EXPECT_EQ(bind_of({"--map-by", "node"}), "auto");  // a placement over hosts (MpirunLines, MapByNode...)
  expect_refused(with_sh(cohort_run({"--map-by", "ppr:2:socket"}), "true"),
                 "cohort run: --map-by ppr:2:socket: not a form cohort maps (supported: slot, node, ppr:N:node, core, "
                 "socket, numa; modifiers such as :PE=n and ppr:N:socket are not)");
  expect_refused(with_sh(cohort_run({"--map-by", "ppr:2:node", "-N", "3"}), "true"),
                 "cohort run: --map-by ppr:2:node and -N/--npernode 3 disagree about the processes per node");
}

TEST(MpirunFlags, ReportBindingsPrintsEachRanksCpusAsItStarts) {
  // Each worker prints the CPUs the kernel lets it use; the launcher's line for its rank must agree.
  auto r = run_process(with_sh(cohort_run({"-n", "2", "-report-bindings", "--bind-to", "core"}),
                               "echo \"cpus $(grep Cpus_allowed_list /proc/self/status | cut -f2)\""),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    std::smatch said, saw;
    ASSERT_TRUE(std::regex_search(r.err, said,
                                  std::regex("cohort run: rank " + std::to_string(rank) + " on (\\S+) \\(local rank " +
                                             std::to_string(rank) + ", pid \\d+\\): bound to CPUs (\\S+)\n")))
        << r.err;
    ASSERT_TRUE(std::regex_search(r.out, saw, std::regex("\\[[^:]+:" + std::to_string(rank) + "\\] cpus (\\S+)\n")))
        << r.out;
    EXPECT_EQ(said[2].str(), saw[1].str()) << r.err << r.out;
  }
  auto unbound = run_process(with_sh(cohort_run({"-n", "2", "--report-bindings", "--bind-to", "none"}), "true"), {}, 30);
  ASSERT_EQ(unbound.exit_code, 0) << unbound.err;
  EXPECT_TRUE(std::regex_search(unbound.err, std::regex(R"(cohort run: rank 1 on \S+ \(local rank 1, pid \d+\): not bound \(may run on any of CPUs \S+\)\n)")))
      << unbound.err;
  EXPECT_EQ(std::regex_search(unbound.err, std::regex(R"(rank 0 on \S+ \(local rank 0, pid \d+\): not bound)")), true)
      << unbound.err;
}

TEST(MpirunFlags, RunAsRootAndOversubscribeAreAcceptedWithANote) {
  auto r = run_process(with_sh(cohort_run({"--allow-run-as-root", "-oversubscribe", "-n", "1"}), "echo ran"), {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "ran\n");
  EXPECT_NE(r.err.find("cohort run: note: --allow-run-as-root means nothing to cohort"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("cohort run: note: --oversubscribe means nothing to a job without -H/--hostfile"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(lines_of(r.err), 2u) << r.err;
}

TEST(MpirunFlags, McaAbortOnNonZeroStatusIsTheAbortPolicy) {
  // mpirun -mca orte_abort_on_non_zero_status 0: a failed rank does not stop the others.
  TempDir dir;
  auto r = run_process(with_sh(cohort_run({"-np", "3", "-mca", "orte_abort_on_non_zero_status", "0"}),
                               launch::rank0_fails_others_outlast_the_report_window(dir)),
                       {}, 30);
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_EQ(read_file(dir.file("done.1")), "done\n");
  EXPECT_EQ(read_file(dir.file("done.2")), "done\n");
  expect_refused(with_sh(cohort_run({"--mca", "orte_abort_on_non_zero_status", "2"}), "true"),
                 "cohort run: -mca orte_abort_on_non_zero_status 2: expected 0 (the job goes on after a failure) or 1 "
                 "(it stops)");
}

TEST(TorchrunFlags, RedirectsSendStreamsToPerRankFilesOnly) {
  TempDir dir;
  const std::string logs = dir.file("logs");
  auto r = run_process(with_sh(cohort_run({"-n", "2", "--log-dir", logs, "--redirects", "3", "--run-id", "job7"}),
                               "echo out$RANK; echo err$RANK >&2"),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    std::string base = logs + "/job7/attempt_0/" + std::to_string(rank);
    EXPECT_EQ(read_file(base + "/stdout.log"), "out" + std::to_string(rank) + "\n");
    EXPECT_EQ(read_file(base + "/stderr.log"), "err" + std::to_string(rank) + "\n");
  }
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.find("err0"), std::string::npos) << r.err;

  // Per local rank: rank 0's stdout and rank 1's stderr go to files; the rest stays on the console.
  auto mixed = run_process(with_sh(cohort_run({"-n", "2", "--log_dir", logs, "-r", "0:1,1:2", "--run-id", "job8"}),
                                   "echo out$RANK; echo err$RANK >&2"),
                           {}, 30);
  ASSERT_EQ(mixed.exit_code, 0) << mixed.err;
  EXPECT_EQ(read_file(logs + "/job8/attempt_0/0/stdout.log"), "out0\n");
  EXPECT_FALSE(exists(logs + "/job8/attempt_0/0/stderr.log"));
  EXPECT_EQ(read_file(logs + "/job8/attempt_0/1/stderr.log"), "err1\n");
  EXPECT_FALSE(exists(logs + "/job8/attempt_0/1/stdout.log"));
  EXPECT_EQ(mixed.out.find("out0"), std::string::npos) << mixed.out;
  EXPECT_NE(mixed.out.find(":1] out1\n"), std::string::npos) << mixed.out;
  EXPECT_NE(mixed.err.find(":0] err0\n"), std::string::npos) << mixed.err;
  EXPECT_EQ(mixed.err.find("err1"), std::string::npos) << mixed.err;
  expect_refused(with_sh(cohort_run({"--redirects", "4"}), "true"),
                 "cohort run: --redirects 4: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both) for every local rank, "
                 "or LOCAL_RANK:N pairs such as 0:1,1:2");
}

TEST(TorchrunFlags, TeeWritesFilesAndTheConsoleAndEachAttemptHasItsFolder) {
  TempDir dir;
  const std::string logs = dir.file("logs");
  auto r = run_process(with_sh(cohort_run({"-n", "1", "--log-dir", logs, "--tee", "3", "--run-id", "job9",
                                           "--max-restarts", "1"}),
                               "echo out$TORCHELASTIC_RESTART_COUNT; echo err$TORCHELASTIC_RESTART_COUNT >&2; "
                               "[ $TORCHELASTIC_RESTART_COUNT = 1 ]"),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_file(logs + "/job9/attempt_0/0/stdout.log"), "out0\n");
  EXPECT_EQ(read_file(logs + "/job9/attempt_1/0/stdout.log"), "out1\n");
  EXPECT_EQ(read_file(logs + "/job9/attempt_1/0/stderr.log"), "err1\n");
  EXPECT_EQ(r.out, "out0\nout1\n");
  EXPECT_NE(r.err.find("err1\n"), std::string::npos) << r.err;

  // --log-dir alone writes nothing, as with torchrun, and says so; --tee without it names the folder.
  auto alone = run_process(with_sh(cohort_run({"--log-dir", logs, "--run-id", "job10"}), "echo hi"), {}, 30);
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  EXPECT_EQ(alone.out, "hi\n");
  EXPECT_FALSE(exists(logs + "/job10"));
  EXPECT_NE(alone.err.find("cohort run: note: --log-dir " + logs + " without --redirects or --tee: no output is written"),
            std::string::npos)
      << alone.err;
  auto default_dir = run_process(with_sh(cohort_run({"--tee", "1", "--run-id", "job11"}), "echo hi"),
                                 {"TMPDIR=" + dir.path()}, 30);
  ASSERT_EQ(default_dir.exit_code, 0) << default_dir.err;
  EXPECT_EQ(read_file(dir.path() + "/cohort-logs/job11/attempt_0/0/stdout.log"), "hi\n");
  EXPECT_NE(default_dir.err.find("the ranks' log files go under " + dir.path() + "/cohort-logs/job11"), std::string::npos)
      << default_dir.err;
  expect_refused(with_sh(cohort_run({"--tee", "3", "--output-filename", logs}), "true"),
                 "cohort run: --output-filename and --log-dir/--redirects/--tee both given: use one way of writing "
                 "per-rank files");
}

TEST(TorchrunFlags, LocalRanksFilterChoosesWhoPrintsOnTheConsole) {
  TempDir dir;
  auto r = run_process(with_sh(cohort_run({"-n", "3", "--local-ranks-filter", "0,2", "--log-dir", dir.path(), "--tee",
                                           "1", "--run-id", "j"}),
                               "echo out$LOCAL_RANK"),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(":0] out0\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(":2] out2\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("out1"), std::string::npos) << r.out;
  EXPECT_EQ(read_file(dir.path() + "/j/attempt_0/1/stdout.log"), "out1\n");  // the files keep every rank
  expect_refused(with_sh(cohort_run({"-n", "2", "--local_ranks_filter", "2"}), "true"),
                 "cohort run: --local-ranks-filter: local rank 2 does not exist (2 processes per node)");
}

TEST(TorchrunFlags, MonitorIntervalIsAcceptedWithANoteSayingWhy) {
  auto r = run_process(with_sh(cohort_run({"--monitor-interval", "5"}), "echo ran"), {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "ran\n");
  EXPECT_EQ(r.err,
            "cohort run: note: --monitor-interval 5: cohort's supervision is event-driven (a worker's exit is seen the "
            "moment the kernel reports it), so there is no interval to set; ignored\n");
  expect_refused(with_sh(cohort_run({"--monitor_interval", "soon"}), "true"),
                 "cohort run: --monitor-interval=soon: expected a duration such as 30, 30s, 500ms or 2m");
}

TEST(CommandLine, BadFlagsAreOneLineNamingTheFlagAsTyped) {
  const std::string tool = cohort_tool();
  expect_refused(cohort_run({"--nproc-pre-node", "2", "/bin/true"}),
                 "cohort run: unknown flag --nproc-pre-node (did you mean --nproc-per-node?) (cohort run --help lists "
                 "the flags)");
  expect_refused(cohort_run({"-n", "2", "-n", "3", "/bin/true"}),
                 "cohort run: -n given twice (-n 2, -n 3); give it once (cohort run --help lists the flags)");
  expect_refused(cohort_run({"--node-rank", "abc", "/bin/true"}),
                 "cohort run: --node-rank abc: expected a whole number (cohort run --help lists the flags)");
  expect_refused(cohort_run({"--nproc-per-node"}),
                 "cohort run: --nproc-per-node needs a value after it: workers per node: N or auto (GPUs, else CPU "
                 "cores) (cohort run --help lists the flags)");
  expect_refused(cohort_run({"--max_restart", "2", "/bin/true"}),
                 "cohort run: unknown flag --max_restart (did you mean --max-restarts?) (cohort run --help lists the "
                 "flags)");
  expect_refused({tool, "store", "serve", "--port", "0", "--hots", "x"},
                 "cohort store serve: unknown flag --hots (did you mean --host?) (cohort store serve --help lists the "
                 "flags)");
  expect_refused({tool, "store", "serve"},
                 "cohort store serve: --port is required: TCP port to listen on (0: any free port) (cohort store serve "
                 "--help lists the flags)");
  expect_refused({tool, "doctor", "-H", "a:1", "--timeout", "x"},
                 "cohort doctor: --timeout x: expected a number (cohort doctor --help lists the flags)");
  expect_refused({tool, "rnu", "-n", "2"}, "cohort: unknown command 'rnu'; did you mean 'cohort run'? (cohort --help "
                                           "lists the commands)");
  expect_refused({tool, "store", "serv"}, "cohort store: unknown command 'serv'; did you mean 'cohort store serve'? "
                                          "(cohort store --help lists its commands)");
  expect_refused({tool, "frobnicate"}, "cohort: unknown command 'frobnicate' (cohort --help lists the commands)");
}

// `cohort --version` names the build: the version and the commit the tree was at when it was built,
// so that a bug report says which code ran.
TEST(CommandLine, VersionNamesTheCommitItWasBuiltFrom) {
  auto r = run_process({cohort_tool(), "--version"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto head = run_process({"git", "-C", COHORT_SOURCE_DIR, "rev-parse", "HEAD"});
  if (head.exit_code != 0) {
    // A source tree without git: the version alone.
    EXPECT_TRUE(std::regex_match(r.out, std::regex(R"(cohort \d+\.\d+\.\d+\n)"))) << r.out;
    return;
  }
  std::smatch m;
  ASSERT_TRUE(std::regex_match(r.out, m, std::regex(R"(cohort \d+\.\d+\.\d+ \((?:\S+-g)?([0-9a-f]{12})(?:-dirty)?\)\n)")))
      << r.out;
  EXPECT_EQ(head.out.substr(0, 12), m[1].str()) << "built from another commit than the checkout's HEAD";
}

}  // namespace
}  // namespace cohort::test
