// Elastic jobs through the real launcher (`cohort run --nnodes MIN:MAX`): agents on this machine,
// each its own `cohort run`, /bin/sh workers that write what they saw. A bash driver starts, kills,
// stops and adds agents; the tests check the generations the workers ran in, the agents' exit codes
// and lines, and that no worker outlives the job. The rendezvous rules themselves are unit-tested in
// rendezvous_test.cc.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "support/test_support.h"

namespace cohort::test {
namespace {

struct Elastic {
  TempDir dir;
  int port = free_port();
  std::string d = dir.path();

  // The agent command: `cohort run --nnodes BOUNDS ... sh -c WORKER`, WORKER writing
  //   D/pid.<generation>.<rank>  and  D/env.<generation>.<rank> = "RANK WORLD_SIZE COHORT_RESTART_COUNT
  //   TORCHELASTIC_RESTART_COUNT GROUP_WORLD_SIZE NODE_RANK start_ns"
  // then running `body` (default: sleep in generation 0, exit 0 after).
  std::string agent(const std::string& bounds, const std::string& flags = "",
                    const std::string& body = "[ $COHORT_RESTART_COUNT = 0 ] && exec sleep 60; exit 0") const {
    std::string worker = "echo $$ > " + d + "/pid.$COHORT_RESTART_COUNT.$RANK; echo \"$RANK $WORLD_SIZE "
                         "$COHORT_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT $GROUP_WORLD_SIZE $NODE_RANK $(date +%s%N)\" > " +
                         d + "/env.$COHORT_RESTART_COUNT.$RANK; " + body;
    return "'" + cohort_tool() + "' run --nnodes " + bounds + " --nproc-per-node 2 --master-addr 127.0.0.1 --master-port " +
           std::to_string(port) + " --kill-grace 1 " + flags + " /bin/sh -c '" + worker + "'";
  }
  // Bash lines: wait for the store's port, or for files.
  std::string wait_port() const {
    return "for i in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/" + std::to_string(port) +
           ") 2>/dev/null && break; sleep 0.05; done; ";
  }
  std::string wait_files(const std::vector<std::string>& names) const {
    std::string test;
    for (const auto& n : names) test += (test.empty() ? "" : " && ") + std::string("[ -s ") + d + "/" + n + " ]";
    return "for i in $(seq 400); do { " + test + "; } && break; sleep 0.05; done; ";
  }
  ProcessResult run(const std::string& script, double timeout_s = 90) const {
    return run_process({"/bin/bash", "-c", script}, {}, timeout_s);
  }
  std::string file(const std::string& name) const { return read_file(dir.file(name)); }
  // The fields of env.<gen>.<rank>.
  std::vector<std::string> env(int gen, int rank) const {
    std::istringstream in(file("env." + std::to_string(gen) + "." + std::to_string(rank)));
    std::vector<std::string> f;
    for (std::string w; in >> w;) f.push_back(w);
    return f;
  }
  void expect_no_worker_left() const {
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    for (int gen = 0; gen < 4; ++gen)
      for (int rank = 0; rank < 8; ++rank) {
        std::string text = file("pid." + std::to_string(gen) + "." + std::to_string(rank));
        if (text.empty()) continue;
        int pid = std::stoi(text);
        while (process_alive(pid) && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        EXPECT_FALSE(process_alive(pid)) << "worker pid " << pid << " (generation " << gen << ", rank " << rank
                                 << ") outlived the job";
      }
  }
};

TEST(Elastic, TwoAgentsMeetAndTheirRanksAreDense) {
  Elastic e;
  auto r = e.run(e.agent("2:3", "--rdzv-conf last_call_timeout=0.2", "exit 0") + " 2> " + e.d + "/a.err & a=$!; " +
                 e.wait_port() + e.agent("2:3", "--rdzv-conf last_call_timeout=0.2", "exit 0") + " 2> " + e.d +
                 "/b.err & b=$!; wait $a; ra=$?; wait $b; rb=$?; echo $ra $rb");
  EXPECT_EQ(r.out, "0 0\n") << e.file("a.err") << e.file("b.err");
  for (int rank = 0; rank < 4; ++rank) {
    auto f = e.env(0, rank);
    ASSERT_EQ(f.size(), 7u) << "rank " << rank;
    EXPECT_EQ(f[0], std::to_string(rank));
    EXPECT_EQ(f[1], "4");
    EXPECT_EQ(f[2], "0");
    EXPECT_EQ(f[4], "2");  // GROUP_WORLD_SIZE: the nodes of the generation
    EXPECT_EQ(f[5], std::to_string(rank / 2));
  }
  EXPECT_NE(e.file("a.err").find("generation 0: 2 node(s)"), std::string::npos) << e.file("a.err");
}

TEST(Elastic, ALostNodeEndsTheGenerationAndTheSurvivorGoesOnWithinSeconds) {
  Elastic e;
  // a hosts the store (it binds the port first); b is SIGKILLed with its workers running.
  auto r = e.run(e.agent("1:2", "--max-restarts 1 --rdzv-conf last_call_timeout=10") + " 2> " + e.d + "/a.err & a=$!; " +
                 e.wait_port() + e.agent("1:2", "--max-restarts 1 --rdzv-conf last_call_timeout=10") + " 2> " + e.d +
                 "/b.err & b=$!; " + e.wait_files({"pid.0.0", "pid.0.1", "pid.0.2", "pid.0.3"}) +
                 "date +%s%N > " + e.d + "/killed; kill -9 $b; wait $a; echo $?");
  EXPECT_EQ(r.out, "0\n") << e.file("a.err");
  std::string err = e.file("a.err");
  EXPECT_NE(err.find("generation 0 ended: lost node"), std::string::npos) << err;
  EXPECT_NE(err.find("its agent's store lease ended"), std::string::npos) << err;
  EXPECT_NE(err.find("generation 1: 1 node(s)"), std::string::npos) << err;
  for (int rank = 0; rank < 2; ++rank) {
    auto f = e.env(1, rank);
    ASSERT_EQ(f.size(), 7u) << err;
    EXPECT_EQ(f[0], std::to_string(rank));
    EXPECT_EQ(f[1], "2") << "the world shrinks to the survivor's ranks";
    EXPECT_EQ(f[2], "1");  // COHORT_RESTART_COUNT: the generation
    EXPECT_EQ(f[3], "1");  // TORCHELASTIC_RESTART_COUNT
    EXPECT_EQ(f[4], "1");
    // From the kill to the new generation's workers: the lease's will ends the generation at once;
    // the workers get the report window (1 s), then the round closes as soon as the survivor is back.
    double seconds = (std::stod(f[6]) - std::stod(e.file("killed"))) / 1e9;
    EXPECT_LT(seconds, 3.0) << "rank " << rank;
  }
  e.expect_no_worker_left();
}

TEST(Elastic, ANewcomerIsAdmittedAtTheNextGenerationWithoutARestartCounted) {
  Elastic e;
  // --max-restarts 0: a membership change is not a restart.
  auto r = e.run(e.agent("1:2", "--rdzv-conf last_call_timeout=0") + " 2> " + e.d + "/a.err & a=$!; " +
                 e.wait_files({"pid.0.0", "pid.0.1"}) + e.agent("1:2", "--rdzv-conf last_call_timeout=0") + " 2> " +
                 e.d + "/b.err & b=$!; wait $a; ra=$?; wait $b; echo $ra $?");
  EXPECT_EQ(r.out, "0 0\n") << e.file("a.err") << e.file("b.err");
  EXPECT_NE(e.file("a.err").find("joins the job (generation 0 has 1 of at most 2 nodes)"), std::string::npos)
      << e.file("a.err");
  EXPECT_NE(e.file("a.err").find("a membership change: no restart counted"), std::string::npos) << e.file("a.err");
  for (int rank = 0; rank < 4; ++rank) {
    auto f = e.env(1, rank);
    ASSERT_EQ(f.size(), 7u) << e.file("a.err") << e.file("b.err");
    EXPECT_EQ(f[1], "4");
    EXPECT_EQ(f[2], "1");
  }
  e.expect_no_worker_left();
}

TEST(Elastic, BelowMinTheJobFailsAtTheRendezvousTimeoutNamingWhatIsMissing) {
  Elastic e;
  auto r = e.run(e.agent("2:4", "--rdzv-timeout 1.5") + "; echo rc=$?");
  EXPECT_NE(r.out.find("rc=1"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.err.find("generation 0: 1 of at least 2 nodes joined within 1.5 s (--rdzv-timeout; --nnodes 2:4)"),
            std::string::npos)
      << r.err;
  EXPECT_LT(r.seconds, 10.0);
}

TEST(Elastic, AFrozenAgentIsDroppedAndSaysSoWhenItWakes) {
  Elastic e;
  // Lease 1 s: b is SIGSTOPped for 3 s; a goes on alone (its generation-1 workers wait for b's end);
  // b, continued, learns it was dropped.
  const std::string body = "[ $COHORT_RESTART_COUNT = 0 ] && exec sleep 60; while [ ! -e " + e.d +
                           "/release ]; do sleep 0.05; done; exit 0";
  auto r = run_process(
      {"/bin/bash", "-c",
       e.agent("1:2", "--max-restarts 1 --rdzv-conf last_call_timeout=10", body) + " 2> " + e.d + "/a.err & a=$!; " +
           e.wait_port() + e.agent("1:2", "--max-restarts 1 --rdzv-conf last_call_timeout=10", body) + " 2> " + e.d +
           "/b.err & b=$!; " + e.wait_files({"pid.0.0", "pid.0.1", "pid.0.2", "pid.0.3"}) +
           "kill -STOP $b; sleep 3; kill -CONT $b; wait $b; rb=$?; touch " + e.d + "/release; wait $a; echo $? $rb"},
      {"COHORT_AGENT_LEASE_S=1"}, 90);
  EXPECT_EQ(r.out, "0 1\n") << e.file("a.err") << e.file("b.err");
  // Whichever it notices first: its lease connection closed by the store ("its lease ran out"), or the
  // generation's end naming it, after which the store refuses it ("its store lease ended").
  EXPECT_NE(e.file("b.err").find("the job dropped this agent"), std::string::npos) << e.file("b.err");
  EXPECT_NE(e.file("b.err").find("lease"), std::string::npos) << e.file("b.err");
  EXPECT_EQ(e.env(1, 0).at(1), "2");
  e.expect_no_worker_left();
}

TEST(Elastic, AnInterruptedAgentLeavesAndTheOthersGoOn) {
  Elastic e;
  auto r = e.run(e.agent("1:2", "--max-restarts 1 --rdzv-conf last_call_timeout=10") + " 2> " + e.d + "/a.err & a=$!; " +
                 e.wait_port() + e.agent("1:2", "--max-restarts 1 --rdzv-conf last_call_timeout=10") + " 2> " + e.d +
                 "/b.err & b=$!; " + e.wait_files({"pid.0.0", "pid.0.1", "pid.0.2", "pid.0.3"}) +
                 "kill -TERM $b; wait $a; ra=$?; wait $b; echo $ra $?");
  EXPECT_EQ(r.out, "0 143\n") << e.file("a.err") << e.file("b.err");
  EXPECT_NE(e.file("a.err").find("left the job: its agent got SIGTERM"), std::string::npos) << e.file("a.err");
  EXPECT_EQ(e.env(1, 1).at(1), "2");
  e.expect_no_worker_left();
}

TEST(Elastic, LosingTheStoresHostMovesTheStoreToASurvivorAndTheJobGoesOn) {
  Elastic e;
  // a hosts the store; b and c keep standby stores. a is SIGKILLed: b and c move the store to the
  // first of them whose standby answers and go on at generation 1 with 4 ranks.
  auto r = e.run(e.agent("1:3", "--max-restarts 1 --rdzv-conf last_call_timeout=10") + " 2> " + e.d + "/a.err & a=$!; " +
                 e.wait_port() + e.agent("1:3", "--max-restarts 1 --rdzv-conf last_call_timeout=10") + " 2> " + e.d +
                 "/b.err & b=$!; " + e.agent("1:3", "--max-restarts 1 --rdzv-conf last_call_timeout=10") + " 2> " +
                 e.d + "/c.err & c=$!; " + e.wait_files({"pid.0.0", "pid.0.1", "pid.0.2", "pid.0.3", "pid.0.4", "pid.0.5"}) +
                 "date +%s%N > " + e.d + "/killed; kill -9 $a; wait $b; rb=$?; wait $c; echo $rb $?");
  EXPECT_EQ(r.out, "0 0\n") << e.file("b.err") << e.file("c.err");
  const std::string both = e.file("b.err") + e.file("c.err");
  EXPECT_NE(both.find("moving the job's store to a surviving member"), std::string::npos) << both;
  EXPECT_NE(both.find("the job's store moved to"), std::string::npos) << both;
  EXPECT_NE(both.find(", this agent)"), std::string::npos) << "one of them hosts it now: " << both;
  EXPECT_NE(both.find("generation 1: 2 node(s)"), std::string::npos) << both;
  for (int rank = 0; rank < 4; ++rank) {
    auto f = e.env(1, rank);
    ASSERT_EQ(f.size(), 7u) << both;
    EXPECT_EQ(f[1], "4");
    EXPECT_LT((std::stod(f[6]) - std::stod(e.file("killed"))) / 1e9, 3.0) << "rank " << rank;
  }
  e.expect_no_worker_left();
}

TEST(Elastic, TheStoresHostLeftWithFewerThanHalfOfItsGenerationStopsSayingWhy) {
  Elastic e;
  // a hosts the store; b, c and d are SIGKILLed at once. To the store that is what a cut between a and
  // the three others looks like, and on the far side of such a cut the three would move the store
  // and go on: so a, with 1 of 4, stops instead of going on alone (MIN is 1).
  const std::string flags = "--max-restarts 1 --rdzv-conf last_call_timeout=10";
  std::string script = e.agent("1:4", flags) + " 2> " + e.d + "/a.err & a=$!; " + e.wait_port();
  for (const char* n : {"b", "c", "d"})
    script += e.agent("1:4", flags) + " 2> " + e.d + "/" + n + ".err & " + n + "=$!; ";
  script += e.wait_files({"pid.0.0", "pid.0.1", "pid.0.2", "pid.0.3", "pid.0.4", "pid.0.5", "pid.0.6", "pid.0.7"}) +
            "kill -9 $b $c $d; wait $a; echo $?";
  auto r = e.run(script);
  EXPECT_EQ(r.out, "1\n") << e.file("a.err");
  const std::string err = e.file("a.err");
  EXPECT_NE(err.find("job stopped (exit 1): generation 1: only 1 of the 4 nodes of generation 0 are left (gone: "),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("stopping so that one copy of the job runs"), std::string::npos) << err;
  EXPECT_EQ(e.file("env.1.0"), "") << "no generation 1 ran";
  EXPECT_LT(r.seconds, 30.0);
  e.expect_no_worker_left();
}

TEST(Elastic, BadBoundsAndFlagsAreOneLineAndExit2) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"--nnodes", "3:2", "--master-addr", "h0"}, "--nnodes 3:2: expected 1 <= MIN <= MAX"},
      {{"--nnodes", "1:x", "--master-addr", "h0"}, "--nnodes 1:x: expected a node count N or MIN:MAX"},
      {{"--nnodes", "1:2"}, "--nnodes 1:2 needs --master-addr or --rdzv-endpoint"},
      {{"--nnodes", "1:2", "--rdzv-endpoint", "h0:29400", "--rdzv-backend", "etcd"},
       "--rdzv-backend etcd: cohort's own store is the rendezvous"},
      {{"--nnodes", "1:2", "--master-addr", "h0", "--rdzv-conf", "read_timeout=3"}, "--rdzv-conf read_timeout=3"},
      {{"--nnodes", "1:2", "--master-addr", "h0", "--ps", "1"}, "cannot be combined"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {cohort_tool(), "run"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    argv.push_back("true");
    auto r = run_process(argv, {}, 30);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

TEST(Elastic, DryRunShowsTheBoundsAndTheEndpoint) {
  auto r = run_process({cohort_tool(), "run", "--dry-run", "--nnodes", "2:4", "--rdzv-endpoint", "node7:29400",
                        "--nproc-per-node", "2", "true"},
                       {}, 30);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("2 to 4, elastic"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("node7:29400"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the agent on the master address's host"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace cohort::test
