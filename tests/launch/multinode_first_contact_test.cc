// The multi-node lines people type first, through the real launcher: several `cohort run` on this
// machine stand for the nodes of a job (as people try it first), /bin/sh workers write what they saw.
//   - torchrun's documented line (`--nnodes N --rdzv-backend c10d --rdzv-endpoint H:P`, no --node-rank,
//     the same on every node): the node ranks are assigned at the rendezvous; jobs with different
//     --rdzv-id on one endpoint never mix.
//   - Interrupts in every phase: waiting for node 0's store, waiting for the other nodes, running:
//     SIGINT/SIGTERM end this node's part within a second or two with 128 + signal, and the other
//     nodes learn it and end, naming the interrupted node.
// Each launcher's join timeout is far above the times checked, so that a launcher that ignores the
// signal (or waits for nodes that never came) fails the test instead of passing by its timeout.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "support/test_support.h"

namespace cohort::test {
namespace {

struct Nodes {
  TempDir dir;
  int port = free_port();
  std::string d = dir.path();

  // A worker that writes "RANK WORLD_SIZE NODE_RANK GROUP_WORLD_SIZE" to D/env.<RANK> and its pid to
  // D/pid.<RANK>, then runs `body`.
  std::string worker(const std::string& body) const {
    return "/bin/sh -c 'echo $$ > " + d + "/pid.$RANK; echo \"$RANK $WORLD_SIZE $NODE_RANK $GROUP_WORLD_SIZE\" > " + d +
           "/env.$RANK; " + body + "'";
  }
  // torchrun's multi-node line, with cohort's spelling of the launcher.
  std::string torchrun_line(const std::string& nnodes, const std::string& rdzv_id, const std::string& body) const {
    return "'" + cohort_tool() + "' run --nnodes=" + nnodes + " --nproc_per_node=1 --rdzv_id=" + rdzv_id +
           " --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:" + std::to_string(port) +
           " --rdzv-conf join_timeout=60 --kill-grace 1 " + worker(body);
  }
  // The per-node line with an explicit node rank (torchrun's static rendezvous, or --master-addr).
  std::string static_line(int node_rank, const std::string& body) const {
    return "'" + cohort_tool() + "' run --nnodes 2 --node-rank " + std::to_string(node_rank) +
           " --nproc-per-node 1 --master-addr 127.0.0.1 --master-port " + std::to_string(port) +
           " --join-timeout 60 --kill-grace 1 " + worker(body);
  }
  // Bash: wait (bounded) until the launcher with pid $VAR reads signals from its signalfd (SIGINT
  // blocked in its mask), i.e. it is past its start-up, where a signal would only kill it.
  static std::string wait_handling_signals(const std::string& var) {
    return "for i in $(seq 400); do grep -q '^SigBlk:.*[2367abef]$' /proc/$" + var +
           "/status 2>/dev/null && break; sleep 0.025; done; ";
  }
  std::string wait_port() const {
    return "for i in $(seq 400); do (exec 3<>/dev/tcp/127.0.0.1/" + std::to_string(port) +
           ") 2>/dev/null && break; sleep 0.025; done; ";
  }
  std::string wait_files(const std::vector<std::string>& names) const {
    std::string test;
    for (const auto& n : names) test += (test.empty() ? "" : " && ") + std::string("[ -s ") + d + "/" + n + " ]";
    return "for i in $(seq 800); do { " + test + "; } && break; sleep 0.025; done; ";
  }
  // Bash: the seconds since $T0 (date +%s%N), as "S.SSS".
  static std::string elapsed(const std::string& t0) {
    return "$(( ($(date +%s%N) - " + t0 + ") / 1000000 ))";
  }
  ProcessResult run(const std::string& script, double timeout_s = 60) const {
    return run_process({"/bin/bash", "-c", script}, {}, timeout_s);
  }
  std::string file(const std::string& name) const { return read_file(dir.file(name)); }
  std::vector<std::string> fields(const std::string& name) const {
    std::istringstream in(file(name));
    std::vector<std::string> f;
    for (std::string w; in >> w;) f.push_back(w);
    return f;
  }
  void expect_no_worker_left() const {
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    for (int rank = 0; rank < 4; ++rank) {
      std::string text = file("pid." + std::to_string(rank));
      if (text.empty()) continue;
      int pid = std::stoi(text);
      while (process_alive(pid) && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      EXPECT_FALSE(process_alive(pid)) << "worker pid " << pid << " (rank " << rank << ") outlived the job";
    }
  }
};

// "out" of the scripts below: "<exit code> <milliseconds>" lines, one per launcher.
std::vector<std::pair<int, int>> codes_and_ms(const std::string& out) {
  std::vector<std::pair<int, int>> v;
  std::istringstream in(out);
  for (int code, ms; in >> code >> ms;) v.emplace_back(code, ms);
  return v;
}

TEST(TorchrunMultiNode, TwoLaunchersWithTheSameLineAndNoNodeRankGetNodeRanksAtTheRendezvous) {
  Nodes n;
  // The same line twice, as typed on two nodes: the first to bind the endpoint hosts the store.
  auto r = n.run(n.torchrun_line("2", "100", "exit 0") + " 2> " + n.d + "/a.err & a=$!; " +
                 n.torchrun_line("2", "100", "exit 0") + " 2> " + n.d + "/b.err & b=$!; " +
                 "wait $a; ra=$?; wait $b; echo $ra $?");
  ASSERT_EQ(r.out, "0 0\n") << n.file("a.err") << "\n---\n" << n.file("b.err");
  std::set<std::string> node_ranks;
  for (int rank = 0; rank < 2; ++rank) {
    auto f = n.fields("env." + std::to_string(rank));
    ASSERT_EQ(f.size(), 4u) << "rank " << rank << ": " << n.file("a.err") << n.file("b.err");
    EXPECT_EQ(f[0], std::to_string(rank));
    EXPECT_EQ(f[1], "2");  // WORLD_SIZE
    EXPECT_EQ(f[3], "2");  // GROUP_WORLD_SIZE: the nodes
    node_ranks.insert(f[2]);
  }
  EXPECT_EQ(node_ranks, (std::set<std::string>{"0", "1"})) << "each launcher is a node of its own";
  EXPECT_EQ((n.file("a.err") + n.file("b.err")).find("already in use"), std::string::npos);
}

TEST(TorchrunMultiNode, AnotherRdzvIdOnTheSameEndpointIsRefusedAndCtrlCEndsTheWaitingNode) {
  Nodes n;
  // Job 100's first node waits for its second; a node of job 200 comes to the same endpoint.
  auto r = n.run(n.torchrun_line("2", "100", "exit 0") + " 2> " + n.d + "/a.err & a=$!; " + n.wait_port() +
                 n.wait_handling_signals("a") + n.torchrun_line("2", "200", "exit 0") + " 2> " + n.d +
                 "/b.err; echo $? 0; t0=$(date +%s%N); kill -INT $a; wait $a; echo $? " + Nodes::elapsed("$t0"));
  auto v = codes_and_ms(r.out);
  ASSERT_EQ(v.size(), 2u) << r.out << r.err;
  EXPECT_EQ(v[0].first, 2) << n.file("b.err");
  EXPECT_NE(n.file("b.err").find("serves job '100', not this node's job '200'"), std::string::npos) << n.file("b.err");
  EXPECT_FALSE(std::ifstream(n.d + "/env.0") && std::ifstream(n.d + "/env.1")) << "the two jobs mixed";
  // Ctrl-C while the job waits for its other node: at once, and with 130.
  EXPECT_EQ(v[1].first, 130) << n.file("a.err");
  EXPECT_LT(v[1].second, 2000) << n.file("a.err");
  EXPECT_NE(n.file("a.err").find("interrupted by SIGINT"), std::string::npos) << n.file("a.err");
}

TEST(Interrupts, ANodeWaitingForNodeZerosStoreEndsAtOnceOnSigint) {
  Nodes n;
  // Nothing listens on the port: node 1 waits for node 0's store.
  auto r = n.run(n.static_line(1, "exit 0") + " 2> " + n.d + "/b.err & b=$!; " + Nodes::wait_handling_signals("b") +
                 "t0=$(date +%s%N); kill -INT $b; wait $b; echo $? " + Nodes::elapsed("$t0"));
  auto v = codes_and_ms(r.out);
  ASSERT_EQ(v.size(), 1u) << r.out << r.err;
  EXPECT_EQ(v[0].first, 130) << n.file("b.err");
  EXPECT_LT(v[0].second, 1500) << n.file("b.err");
  EXPECT_NE(n.file("b.err").find("interrupted by SIGINT while waiting for node 0's store"), std::string::npos)
      << n.file("b.err");
}

TEST(Interrupts, NodeZeroWaitingForTheOthersEndsAtOnceOnSigterm) {
  Nodes n;
  auto r = n.run(n.static_line(0, "exit 0") + " 2> " + n.d + "/a.err & a=$!; " + n.wait_port() +
                 Nodes::wait_handling_signals("a") + "t0=$(date +%s%N); kill -TERM $a; wait $a; echo $? " +
                 Nodes::elapsed("$t0"));
  auto v = codes_and_ms(r.out);
  ASSERT_EQ(v.size(), 1u) << r.out << r.err;
  EXPECT_EQ(v[0].first, 143) << n.file("a.err");
  EXPECT_LT(v[0].second, 1500) << n.file("a.err");
}

TEST(Interrupts, ANodeInterruptedWhileTheJobRunsEndsItOnEveryNodeNamingIt) {
  Nodes n;
  // A job whose node ranks came from the rendezvous (it cannot go on without a node): node b's
  // launcher gets Ctrl-C while both nodes' workers run; both launchers end within seconds.
  auto r = n.run(n.torchrun_line("2", "7", "exec sleep 60") + " 2> " + n.d + "/a.err & a=$!; " + n.wait_port() +
                 n.torchrun_line("2", "7", "exec sleep 60") + " 2> " + n.d + "/b.err & b=$!; " +
                 n.wait_files({"pid.0", "pid.1"}) + Nodes::wait_handling_signals("b") +
                 "t0=$(date +%s%N); kill -INT $b; wait $b; echo $? " + Nodes::elapsed("$t0") + "; wait $a; echo $? " +
                 Nodes::elapsed("$t0"));
  auto v = codes_and_ms(r.out);
  ASSERT_EQ(v.size(), 2u) << r.out << r.err << n.file("a.err") << n.file("b.err");
  EXPECT_EQ(v[0].first, 130) << n.file("b.err");
  EXPECT_LT(v[0].second, 2500) << n.file("b.err");
  EXPECT_NE(v[1].first, 0) << n.file("a.err");
  EXPECT_LT(v[1].second, 5000) << n.file("a.err");
  // The other node names the interrupted one (b is node 1: a hosts the store, and the store's host
  // is node 0).
  EXPECT_NE(n.file("a.err").find("interrupted by SIGINT on node 1"), std::string::npos) << n.file("a.err");
  n.expect_no_worker_left();
}

TEST(Interrupts, WaitingForNodeZeroSaysRealTimeAndEndsAtTheJoinTimeout) {
  Nodes n;
  // --join-timeout 6: one progress line at about 5 s, then the timeout, with nothing but real time.
  auto r = n.run("t0=$(date +%s%N); '" + cohort_tool() + "' run --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 " +
                 "--master-port " + std::to_string(n.port) + " --join-timeout 6 /bin/true 2> " + n.d +
                 "/b.err; echo $? " + Nodes::elapsed("$t0"));
  auto v = codes_and_ms(r.out);
  ASSERT_EQ(v.size(), 1u) << r.out << r.err;
  const std::string err = n.file("b.err");
  EXPECT_EQ(v[0].first, 1) << err;
  EXPECT_LT(v[0].second, 8000) << err;
  EXPECT_EQ(err.find(" 0 us"), std::string::npos) << err;
  EXPECT_NE(err.find("did not answer within 6 s"), std::string::npos) << err;
  // Every "(S s of 6 s)" counter is no later than the real time of the whole run, and none repeats.
  std::regex counter(R"(\((\d+) s of 6 s\))");
  std::set<std::string> seen;
  int lines = 0;
  for (auto it = std::sregex_iterator(err.begin(), err.end(), counter); it != std::sregex_iterator(); ++it) {
    ++lines;
    EXPECT_LE(std::stoi((*it)[1]) * 1000, v[0].second) << err;
    EXPECT_TRUE(seen.insert((*it)[1]).second) << "repeated counter: " << err;
  }
  EXPECT_GE(lines, 1) << err;
}

}  // namespace
}  // namespace cohort::test
