// `cohort run --ray` with real processes on this host, against the stand-in for Ray's command line
// (tests/ray/ray: Ray cannot be installed here; docs/ray.md says what was run against what). The
// multi-host behaviour (4 nodes, a killed node, a node that never joins) is tests/multihost/test_ray.sh.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "common/socket.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

// A copy of the stand-in in a folder of the test's own, where it logs every call (calls.log).
struct StandIn {
  TempDir dir;
  std::string ray = dir.file("ray");
  StandIn() {
    std::filesystem::copy_file(std::string(COHORT_SOURCE_DIR) + "/tests/ray/ray", ray);
    std::filesystem::permissions(ray, std::filesystem::perms::owner_all);
  }
  // The logged calls, one JSON object each.
  std::vector<nlohmann::json> calls() const {
    std::vector<nlohmann::json> out;
    std::istringstream in(read_file(dir.file("calls.log")));
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  std::vector<nlohmann::json> events(const std::string& event) const {
    std::vector<nlohmann::json> out;
    for (auto& c : calls())
      if (c["event"] == event) out.push_back(c);
    return out;
  }
};

std::vector<std::string> ray_run(const StandIn& s, std::vector<std::string> flags, const std::string& driver) {
  std::vector<std::string> argv{cohort_tool(), "run", "--ray", "--ray-command", s.ray, "--kill-grace", "2"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), {"/bin/sh", "-c", driver});
  return argv;
}

// Every process the stand-in started (the `ray start` commands and their node processes) has ended.
void expect_nothing_left(const StandIn& s) {
  std::vector<int> pids;
  for (auto& c : s.events("started")) {
    pids.push_back(c["pid"].get<int>());
    pids.push_back(c["daemon"].get<int>());
  }
  ASSERT_FALSE(pids.empty());
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  for (int pid : pids) {
    while (process_alive(pid) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(process_alive(pid)) << "Ray process " << pid << " outlived the job";
    if (process_alive(pid)) kill(pid, SIGKILL);
  }
}

TEST(RayRun, OneNodeClusterRunsTheDriverOnceWithItsEnvironmentAndEndsWithIt) {
  StandIn s;
  auto r = run_process(ray_run(s, {},
                               "echo \"driver RANK=$RANK HEAD_PORT=$HEAD_PORT RAY_ADDRESS=$RAY_ADDRESS\"; " + s.ray +
                                   " status --address \"$RAY_ADDRESS\" | grep -c '^ 1 node_'"),
                       {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto started = s.events("started");
  ASSERT_EQ(started.size(), 1u) << r.out << r.err;
  EXPECT_TRUE(started[0]["head"].get<bool>());
  EXPECT_EQ(started[0]["ip"], "127.0.0.1");
  EXPECT_EQ(started[0]["resources"], nlohmann::json::parse(R"({"Rank:0": 1})"));
  const std::string gcs = started[0]["gcs"];
  const std::string port = gcs.substr(gcs.rfind(':') + 1);
  EXPECT_NE(r.out.find("[" + net::hostname() + ":driver] driver RANK=0 HEAD_PORT=" + port + " RAY_ADDRESS=" + gcs),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(":driver] 1\n"), std::string::npos) << "the driver sees 1 node:\n" << r.out;
  EXPECT_NE(r.err.find("cohort run: the Ray cluster at " + gcs + " has its 1 node"), std::string::npos) << r.err;
  // The driver ran once, after the head had started; the head was stopped by SIGTERM at the end.
  EXPECT_EQ(s.events("stopped").size(), 1u);
  expect_nothing_left(s);
}

TEST(RayRun, TheDriversExitCodeIsTheJobs) {
  StandIn s;
  auto r = run_process(ray_run(s, {}, "echo about to fail >&2; exit 3"), {}, 60);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("job failed (exit 3): the driver on " + net::hostname()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("| about to fail"), std::string::npos) << r.err;
  expect_nothing_left(s);
}

TEST(RayRun, AHeadPortInUseIsRefusedBeforeRayStarts) {
  StandIn s;
  auto held = net::listen_tcp("", 0, 1, false);  // another Ray head, as far as the job can tell
  const int port = net::local_address(held.get()).port();
  auto r = run_process(ray_run(s, {"--ray-port", std::to_string(port)}, "echo never"), {}, 60);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("node 0 (" + net::hostname() + "): the Ray head's GCS port " + std::to_string(port) +
                       " (--ray-port) is in use on " + net::hostname()),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("never"), std::string::npos);
  EXPECT_TRUE(s.events("start").empty()) << "ray start ran";
}

TEST(RayRun, AKilledRayNodeEndsTheJobNamingIt) {
  StandIn s;
  std::thread killer([&] {
    // Once the driver runs, kill the head's `ray start --block` (its node's Ray is then gone).
    for (int i = 0; i < 300; ++i) {
      auto started = s.events("started");
      if (!started.empty() && s.events("status").size() >= 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        kill(started[0]["pid"].get<int>(), SIGKILL);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  auto r = run_process(ray_run(s, {}, "sleep 30"), {}, 60);
  killer.join();
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.err;
  EXPECT_NE(r.err.find("the Ray head (node 0) on " + net::hostname()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("was killed by SIGKILL"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(net::hostname() + "'s Ray node is gone"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 20) << "the driver (sleep 30) must be stopped with the job";
  expect_nothing_left(s);
}

TEST(RayRun, TheSeedsEnvironmentInTheDryRunAndAMissingRay) {
  StandIn s;
  auto dry = run_process({cohort_tool(), "run", "--dry-run", "--ray", "--nnodes", "4", "--ray-command", s.ray,
                          "/bin/sh", "-c", "python3 job.py"},
                         {"HEAD_ADDR=train-head-0", "HEAD_PORT=6379", "RANK=0"}, 30);
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  for (const char* want : {"  this node rank  0  [RANK]", "  store           train-head-0:29500",
                           "GCS 6379  [HEAD_PORT]", "TI-ONE (Ray)", "node 0 (" /* this machine */,
                           "the driver (once every node has joined): HEAD_ADDR=train-head-0 HEAD_PORT=6379 RANK=0",
                           "node 3 (node3, its own launcher): Ray node 3"})
    EXPECT_NE(dry.out.find(want), std::string::npos) << "missing: " << want << "\n" << dry.out;
  EXPECT_TRUE(s.calls().empty()) << "a dry run starts nothing";

  auto missing = run_process({cohort_tool(), "run", "--ray", "--ray-command", s.dir.file("no-ray"), "true"}, {}, 30);
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("program '" + s.dir.file("no-ray") +
                             "' does not exist (cohort run --ray starts each node's Ray with it: install Ray on every "
                             "node, or name the executable with --ray-command)"),
            std::string::npos)
      << missing.err;
}

}  // namespace
}  // namespace cohort::test
