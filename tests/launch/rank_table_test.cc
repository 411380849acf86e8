// Ascend HCCL rank tables (RANK_TABLE_FILE): both layouts, the node found by this host's address,
// DEVICE_ID / RANK_ID / RANK_SIZE for each worker, and one line naming the field for bad tables.
#include <gtest/gtest.h>

#include "cohort/error.h"
#include "launch/parsers.h"
#include "launch/plan.h"
#include "launch_test_util.h"
#include "support/test_support.h"

namespace cohort::launch {
namespace {

// Two servers of two devices, version 1.0 (numbers as strings, as the tools write them).
const char* kTable10 = R"({
  "version": "1.0", "server_count": "2", "status": "completed",
  "server_list": [
    {"server_id": "10.0.0.1", "host_nic_ip": "reserve",
     "device": [{"device_id": "0", "device_ip": "192.168.100.1", "rank_id": "0"},
                {"device_id": "1", "device_ip": "192.168.101.1", "rank_id": "1"}]},
    {"server_id": "10.0.0.2", "host_nic_ip": "reserve",
     "device": [{"device_id": "4", "device_ip": "192.168.100.2", "rank_id": "2"},
                {"device_id": "5", "device_ip": "192.168.101.2", "rank_id": "3"}]}]})";

// The same cluster in the older 0.x layout: one instance per rank.
const char* kTable0x = R"({
  "status": "completed", "group_count": "1",
  "group_list": [{"group_name": "hccl_world_group", "device_count": "4", "instance_count": "4",
    "instance_list": [
      {"pod_name": "p0", "server_id": "10.0.0.1", "rank_id": "0", "devices": [{"device_id": "0", "device_ip": "192.168.100.1"}]},
      {"pod_name": "p1", "server_id": "10.0.0.1", "rank_id": "1", "devices": [{"device_id": "1", "device_ip": "192.168.101.1"}]},
      {"pod_name": "p2", "server_id": "10.0.0.2", "rank_id": "2", "devices": [{"device_id": "4", "device_ip": "192.168.100.2"}]},
      {"pod_name": "p3", "server_id": "10.0.0.2", "rank_id": "3", "devices": [{"device_id": 5, "device_ip": "192.168.101.2"}]}]}]})";

TEST(RankTable, BothLayoutsGiveTheSameServersDevicesAndRanks) {
  for (const char* text : {kTable10, kTable0x}) {
    RankTable t = parse_rank_table(text, "t.json");
    ASSERT_EQ(t.servers.size(), 2u);
    EXPECT_EQ(t.rank_size, 4);
    EXPECT_EQ(t.servers[1].server_id, "10.0.0.2");
    ASSERT_EQ(t.servers[1].devices.size(), 2u);
    EXPECT_EQ(t.servers[1].devices[1].device_id, 5);
    EXPECT_EQ(t.servers[1].devices[1].rank_id, 3);
    EXPECT_EQ(t.servers[0].devices[1].device_ip, "192.168.101.1");
    EXPECT_EQ(rank_table_node(t, {"host", "127.0.0.1", "10.0.0.2"}), 1);
    EXPECT_EQ(rank_table_node(t, {"elsewhere"}), -1);
  }
  EXPECT_EQ(parse_rank_table(kTable10, "t").layout, "1.0");
  EXPECT_EQ(parse_rank_table(kTable0x, "t").layout, "0.x");
}

TEST(RankTable, BadTablesGetOneLineNamingTheField) {
  auto err = [](const std::string& text) { return error_of([&] { parse_rank_table(text, "t.json"); }); };
  EXPECT_NE(err("{").find("RANK_TABLE_FILE t.json: not valid JSON"), std::string::npos);
  EXPECT_EQ(err(R"({"version": "1.0"})"),
            "RANK_TABLE_FILE t.json: expected server_list (version 1.0) or group_list (0.x)");
  EXPECT_EQ(err(R"({"server_count": "2", "server_list": [{"server_id": "a", "device": [{"device_id": "0", "rank_id": "0"}]}]})"),
            "RANK_TABLE_FILE t.json: server_count 2 but server_list has 1 entries");
  EXPECT_EQ(err(R"({"server_list": [{"server_id": "a", "device": [{"device_id": "x", "rank_id": "0"}]}]})"),
            "RANK_TABLE_FILE t.json: server_list[0].device[0].device_id: \"x\" is not a number >= 0");
  EXPECT_EQ(err(R"({"server_list": [{"server_id": "a", "device": [{"device_id": "0"}]}]})"),
            "RANK_TABLE_FILE t.json: server_list[0].device[0]: missing \"rank_id\"");
  EXPECT_EQ(err(R"({"server_list": [{"device": [{"device_id": "0", "rank_id": "0"}]}]})"),
            "RANK_TABLE_FILE t.json: server_list[0]: missing \"server_id\" (a non-empty string)");
  EXPECT_EQ(err(R"({"server_list": [{"server_id": "a", "device": []}]})"),
            "RANK_TABLE_FILE t.json: server_list[0]: missing \"device\" (a non-empty list)");
  EXPECT_EQ(err(R"({"server_list": [{"server_id": "a", "device": [{"device_id": "0", "rank_id": "1"}, {"device_id": "1", "rank_id": "1"}]}]})"),
            "RANK_TABLE_FILE t.json: rank_id 1 appears twice");
  EXPECT_EQ(err(R"({"server_list": [{"server_id": "a", "device": [{"device_id": "0", "rank_id": "7"}]}]})"),
            "RANK_TABLE_FILE t.json: rank_id 7 on server a is not below the 1 ranks of the table");
  EXPECT_EQ(err(R"({"server_list": [{"server_id": "a", "device": [{"device_id": "3", "rank_id": "0"}, {"device_id": "3", "rank_id": "1"}]}]})"),
            "RANK_TABLE_FILE t.json: server_list[0].device[1].device_id: device 3 appears twice on server a");
  EXPECT_EQ(err(R"({"group_list": [{"instance_list": [{"server_id": "a", "rank_id": "0", "devices": [{"device_id": "0"}, {"device_id": "1"}]}]}]})"),
            "RANK_TABLE_FILE t.json: group_list[0].instance_list[0].devices: 2 entries; an instance is one rank on one device");
}

TEST(RankTable, TheSchedulerEnvironmentFindsThisNodeAndEveryWorkerGetsItsDevice) {
  test::TempDir dir;
  test::write_file(dir.file("t.json"), kTable10);
  EnvMap env{{"RANK_TABLE_FILE", dir.file("t.json")}};
  auto info = read_scheduler_env(env, {"node-b", "10.0.0.2"});
  EXPECT_EQ(info.nnodes->value, 2);
  EXPECT_EQ(info.node_rank->value, 1);
  EXPECT_EQ(info.node_rank->source, "RANK_TABLE_FILE (server_id of this host)");
  EXPECT_EQ(info.nproc_per_node->value, 2);
  EXPECT_EQ(info.master_addr->value, "10.0.0.1");
  EXPECT_EQ(error_of([&] { read_scheduler_env(env, {"node-c", "10.0.0.3"}); }),
            "RANK_TABLE_FILE " + dir.file("t.json") +
                ": no server_id is an address of this host (node-c, 10.0.0.3); servers: 10.0.0.1, 10.0.0.2 (or give "
                "--node-rank)");
  EXPECT_EQ(error_of([&] { read_scheduler_env({{"RANK_TABLE_FILE", dir.file("none.json")}}, {}); }),
            "RANK_TABLE_FILE " + dir.file("none.json") + ": cannot read it: No such file or directory");
  // The reason, not only the fact (a folder given by mistake).
  EXPECT_EQ(error_of([&] { read_scheduler_env({{"RANK_TABLE_FILE", dir.path()}}, {}); }),
            "RANK_TABLE_FILE " + dir.path() + ": cannot read it: it is a directory");

  Options o;
  o.program = {"train"};
  MachineFacts m;
  m.hostname = "node-b";
  m.addresses = {"node-b", "10.0.0.2"};
  m.resolve_program = [](const std::string& p) { return "/bin/" + p; };
  Plan p = build_plan(o, env, m);
  EXPECT_EQ(p.nnodes, 2);
  EXPECT_EQ(p.this_node, 1);
  EXPECT_EQ(p.world_size, 4);
  auto w = worker_env(p, WorkerSlot{3, 1, 2, 1, {}}, "10.0.0.1:29500", 1, "t", 0, {});
  EXPECT_EQ(env_value(w, "RANK"), "3");
  EXPECT_EQ(env_value(w, "DEVICE_ID"), "5");
  EXPECT_EQ(env_value(w, "RANK_ID"), "3");
  EXPECT_EQ(env_value(w, "RANK_SIZE"), "4");
  std::string dry = describe_plan(p, env, "10.0.0.1:29500");
  EXPECT_NE(dry.find("RANK_TABLE_FILE (devices per server)"), std::string::npos) << dry;
  EXPECT_NE(dry.find("Ascend rank table"), std::string::npos) << dry;
}

}  // namespace
}  // namespace cohort::launch
