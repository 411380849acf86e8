// cohort doctor's building blocks on this machine: host lists, hostfiles, requirements, the probe
// server and the link probe over real loopback sockets, and the child-process helper's deadlines.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <thread>

#include "cohort/error.h"
#include "cohort/version.h"
#include "common/build_info.h"
#include "launch/doctor_checks.h"
#include "launch/doctor_child.h"
#include "launch/doctor_probe.h"
#include "common/socket.h"
#include "support/test_support.h"

using namespace cohort;
using namespace cohort::doctor;
using namespace std::chrono_literals;

TEST(DoctorHosts, ParsesHostListWithAndWithoutSlots) {
  auto h = parse_host_list("a:2,b,c:8");
  ASSERT_EQ(h.size(), 3u);
  EXPECT_EQ(h[0].name, "a");
  EXPECT_EQ(h[0].slots, 2);
  EXPECT_EQ(h[1].name, "b");
  EXPECT_EQ(h[1].slots, 1);
  EXPECT_EQ(h[2].slots, 8);
  EXPECT_THROW(parse_host_list("a:x"), ConfigError);
  EXPECT_THROW(parse_host_list("a:0"), ConfigError);
  EXPECT_THROW(parse_host_list(""), ConfigError);
}

// The doctor reads hostfiles with the launcher's parser: what `cohort run` refuses, it refuses too,
// with the same line.
TEST(DoctorHosts, ParsesHostfileForms) {
  test::TempDir dir;
  test::write_file(dir.file("h"), "# cluster\nnode1 slots=4 max_slots=8\nnode2:2\n\nnode3  # default\n");
  auto h = parse_hostfile(dir.file("h"));
  ASSERT_EQ(h.size(), 3u);
  EXPECT_EQ(h[0].name, "node1");
  EXPECT_EQ(h[0].slots, 4);
  EXPECT_EQ(h[1].name, "node2");
  EXPECT_EQ(h[1].slots, 2);
  EXPECT_EQ(h[2].name, "node3");
  EXPECT_EQ(h[2].slots, 1);
  EXPECT_THROW(parse_hostfile(dir.file("missing")), ConfigError);
  test::write_file(dir.file("bad"), "node1 slots=2\n!!bad line here\n");
  try {
    parse_hostfile(dir.file("bad"));
    FAIL() << "accepted a line that is no host";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), dir.file("bad") + ":2: '!!bad' is not a host name ('!' cannot appear in one); "
                                                        "expected lines of 'HOST [slots=N] [max_slots=M]'");
  }
}

// `cohort doctor` alone checks this machine the way `cohort run` starts workers here: without ssh.
// The ssh command is one that always fails, so any use of ssh would fail the verdict; the host may
// be named in any of the ways that mean this machine.
TEST(DoctorLocal, ThisMachineIsCheckedWithoutSsh) {
  char name[256] = {};
  ASSERT_EQ(gethostname(name, sizeof name - 1), 0);
  for (std::vector<std::string> hosts : {std::vector<std::string>{}, {"-H", "127.0.0.1:2"}, {"-H", std::string(name) + ":2"}}) {
    std::vector<std::string> argv = {test::cohort_tool(), "doctor", "--ssh-command", "false", "--timeout", "10"};
    argv.insert(argv.end(), hosts.begin(), hosts.end());
    auto r = test::run_process(argv, {}, 90);
    SCOPED_TRACE(r.out + r.err);
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_NE(r.out.find("verdict: PASS"), std::string::npos);
    EXPECT_NE(r.out.find(" local "), std::string::npos);  // the host table's access column
    EXPECT_EQ(r.out.find("ssh exited"), std::string::npos);
    EXPECT_NE(r.out.find("allreduce: "), std::string::npos);
    EXPECT_NE(r.out.find(" ... ok"), std::string::npos);  // the tiny allreduce ran, here
  }
}

// A host that is not this machine still goes through ssh (here one that fails at once).
TEST(DoctorLocal, OtherHostsStillGoThroughSsh) {
  auto r = test::run_process({test::cohort_tool(), "doctor", "--ssh-command", "false", "--timeout", "5", "-H",
                              "node-that-is-not-here:1", "--no-allreduce"},
                             {}, 60);
  SCOPED_TRACE(r.out + r.err);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("unreachable over ssh: ssh exited with 1"), std::string::npos);
}

TEST(DoctorRequirements, ScaleWithWorldAndNodes) {
  auto r = requirements_for(8, 4);
  EXPECT_EQ(r.listen_backlog, 12);
  EXPECT_EQ(r.open_files, 80u);
  EXPECT_EQ(requirements_for(4400, 550).listen_backlog, 4950);
}

TEST(DoctorProbe, HostFactsDescribeThisMachine) {
  auto listener = net::listen_tcp("127.0.0.1", 0, 1, false);
  int busy = net::local_address(listener.get()).port();
  auto f = collect_host_facts({busy});
  EXPECT_EQ(f.version, build::version_text());
  EXPECT_GT(f.nofile_soft, 0u);
  ASSERT_EQ(f.ports_free.size(), 1u);
  // Bound on 127.0.0.1 only; 0.0.0.0 on the same port still conflicts on Linux without SO_REUSEPORT.
  EXPECT_FALSE(f.ports_free[0]);
  auto round_trip = HostFacts::from_json(f.to_json());
  EXPECT_EQ(round_trip.somaxconn, f.somaxconn);
  EXPECT_EQ(round_trip.ports_checked, f.ports_checked);
}

TEST(DoctorProbe, LinkProbeMeasuresALoopbackServer) {
  // The probe server as `cohort doctor --serve-probe` runs it: facts line on stdout, then probes
  // until stdin closes.
  Child server({test::cohort_tool(), "doctor", "--serve-probe", "--bind", "127.0.0.1", "--serve-seconds", "30"});
  auto line = server.read_line(Deadline::after(10s));
  ASSERT_TRUE(line.has_value()) << server.err();
  auto facts = HostFacts::from_json(nlohmann::json::parse(*line));
  ASSERT_GT(facts.probe_port, 0);
  auto r = probe_link("127.0.0.1", facts.probe_port, 4u << 20, 10, Deadline::after(10s));
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_GT(r.rtt_us, 0);
  EXPECT_GT(r.bandwidth_MBps, 0);
  EXPECT_LT(std::abs(r.clock_offset_ms), 50);  // same clock on both ends
  server.close_stdin();
  EXPECT_EQ(server.wait(Deadline::after(5s)), 0);
  EXPECT_FALSE(server.timed_out());
}

TEST(DoctorProbe, RefusedLinkIsReportedNotThrown) {
  int port = test::free_port();
  auto r = probe_link("127.0.0.1", port, 1024, 2, Deadline::after(3s));
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find(std::to_string(port)), std::string::npos) << r.error;
}

TEST(DoctorChild, DeadlineKillsAHungChild) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_child({"sleep", "30"}, Deadline::after(300ms));
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.exit_code, 128 + 9);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST(DoctorChild, CapturesOutputAndExitCode) {
  auto r = run_child({"sh", "-c", "echo out; echo err >&2; exit 3"}, Deadline::after(10s));
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.out, "out\n");
  EXPECT_EQ(r.err, "err\n");
}
