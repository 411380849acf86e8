// Parameter-server jobs through the launcher: roles and their environment, the built-in server and
// a program that serves itself, consistency modes, --dry-run, TF_CONFIG with ps entries, and a
// server killed mid-job.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "support/cohort_run.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(PsLaunch, BuiltinServerAndTwoWorkersRunAJob) {
  auto r = run_process(cohort_run({"--ps", "1", "--nproc-per-node", "2", COHORT_PS_WORKER, "basic"}), {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("worker 0 of 2 ok (1 servers, mode async, RANK=0 WORLD_SIZE=2)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("worker 1 of 2 ok (1 servers, mode async, RANK=1 WORLD_SIZE=2)"), std::string::npos) << r.out;
}

TEST(PsLaunch, TwoServersBspModeAndAProgramThatServesItself) {
  auto r = run_process(cohort_run({"--ps", "2", "--ps-mode", "bsp", "--ps-server", "program", "--nproc-per-node", "2",
                                   COHORT_PS_WORKER, "serve"}),
                       {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(count(r.out, "ok (2 servers, mode bsp"), 2u) << r.out;
  // Servers that build a world communicator meet each other, not the workers.
  EXPECT_EQ(count(r.out, "of 2: 2 servers met"), 2u) << r.out;
}

TEST(PsLaunch, DryRunShowsTheRolesAndTheirEnvironment) {
  auto r = run_process(cohort_run({"--dry-run", "--ps", "2", "--ps-mode", "stale:3", "--nproc-per-node", "2",
                                   COHORT_PS_WORKER}),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("roles           2 workers, 2 parameter servers [--ps] running cohort ps serve; mode stale:3 "
                       "[--ps-mode]"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("parameter server 1 (local 3)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("COHORT_ROLE=server COHORT_ROLE_INDEX=1 COHORT_NUM_SERVERS=2 COHORT_NUM_WORKERS=2"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("rank 1 (local 1)"), std::string::npos) << r.out;
}

TEST(PsLaunch, TfConfigWithPsEntriesMakesThisNodeAServer) {
  const std::string tf =
      R"({"cluster": {"chief": ["a:2222"], "worker": ["b:2222"], "ps": ["c:2222", "d:2222"]},)"
      R"( "task": {"type": "ps", "index": 1}})";
  auto r = run_process(cohort_run({"--dry-run", COHORT_PS_WORKER}), {"TF_CONFIG=" + tf}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("this node rank  3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("2 workers, 2 parameter servers [TF_CONFIG (cluster.ps)]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("parameter server 1 (local 0)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("rank 0 (local"), std::string::npos) << "a ps node runs no worker\n" << r.out;

  auto bad = run_process(cohort_run({"--dry-run", COHORT_PS_WORKER}),
                         {R"(TF_CONFIG={"cluster": {"worker": ["a:1"], "ps": "c:2"}, "task": {"type": "ps"}})"}, 30);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("TF_CONFIG: cluster.ps must be a list"), std::string::npos) << bad.err;
}

TEST(PsLaunch, BadPsFlagsGetOneLine) {
  auto r = run_process(cohort_run({"--ps", "0", COHORT_PS_WORKER}), {}, 30);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--ps 0: expected a positive number of servers"), std::string::npos) << r.err;
  r = run_process(cohort_run({"--ps", "1", "--ps-mode", "sync", COHORT_PS_WORKER}), {}, 30);
  EXPECT_NE(r.err.find("--ps-mode sync: expected async, bsp or stale:K"), std::string::npos) << r.err;
  r = run_process(cohort_run({"--ps-mode", "bsp", COHORT_PS_WORKER}), {}, 30);
  EXPECT_NE(r.err.find("--ps-mode needs --ps N"), std::string::npos) << r.err;
}

// A server SIGKILLed mid-job: every worker fails at once naming it, and the job ends naming it.
TEST(PsLaunch, KilledServerFailsEveryWorkerNamingIt) {
  TempDir dir;
  const std::string script = "out=" + dir.file("out") + "\ntool=" + cohort_tool() + "\nworker=" + COHORT_PS_WORKER +
                             R"SH(
    "$tool" run --run-id psk$$ --ps 1 --nproc-per-node 2 "$worker" loop >$out 2>&1 &
    launcher=$!
    for i in $(seq 200); do [ "$(grep -c looping $out)" -ge 2 ] && break; sleep 0.05; done
    server=""
    for p in /proc/[0-9]*; do
      if tr '\0' '\n' < $p/environ 2>/dev/null | grep -qx "COHORT_JOB_ID=psk$$" &&
         tr '\0' '\n' < $p/environ 2>/dev/null | grep -qx "COHORT_ROLE=server"; then server=${p#/proc/}; fi
    done
    [ -n "$server" ] || { echo "no server found"; cat $out; kill $launcher; exit 3; }
    t0=$(date +%s%N)
    kill -9 $server
    wait $launcher
    rc=$?
    t1=$(date +%s%N)
    cat $out
    echo "launcher rc=$rc after_kill_ms=$(( (t1 - t0) / 1000000 ))"
  )SH";
  auto r = run_process({"bash", "-c", script}, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("launcher rc=137"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("parameter server 0 on"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("was killed by SIGKILL"), std::string::npos) << r.out;
  // Each worker says itself which server it lost (before the launcher's stop reaches it).
  EXPECT_NE(r.out.find("parameter-server worker 0:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("parameter-server worker 1:"), std::string::npos) << r.out;
  EXPECT_GE(count(r.out, "parameter server 0 ("), 2u) << r.out;
  auto at = r.out.find("after_kill_ms=");
  ASSERT_NE(at, std::string::npos);
  int ms = std::stoi(r.out.substr(at + 14));
  EXPECT_LE(ms, 2000) << r.out;
}

#ifdef COHORT_PS_CTR
// examples/ps_ctr: the sparse wide model on hashed Fashion-MNIST features reaches its stated accuracy
// (docs/parameter-server.md: 0.83 measured; 0.82 asserted).
TEST(PsExample, CtrTrainsToItsStatedAccuracy) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist"))
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  auto r = run_process(cohort_run({"--ps", "1", "--nproc-per-node", "2", COHORT_PS_CTR}), {}, 110);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("step 10 "), std::string::npos) << "loss every 10 steps\n" << r.out;
  auto at = r.out.find("test accuracy: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  double accuracy = std::stod(r.out.substr(at + 15));
  EXPECT_GE(accuracy, 0.82) << r.out;
}
#endif

}  // namespace
}  // namespace cohort::test
