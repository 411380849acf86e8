// Unit tests of the parameter servers' placement (--ps, src/launch/plan_ps.cc).

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "launch/plan.h"
#include "launch_test_util.h"
#include "plan_test_util.h"

namespace cohort::launch {
namespace {

// --ps N: server k runs on node k mod nnodes, after that node's workers; workers keep a dense
// RANK 0..W-1 among themselves and servers are numbered apart (docs/parameter-server.md).
TEST(Plan, ParameterServersArePlacedAfterEachNodesWorkers) {
  auto o = with_program();
  o.hosts = "here:2,b:2";
  o.ps = 3;
  o.ps_mode = "stale:2";
  auto p = build_plan(o, {}, facts());
  ASSERT_EQ(p.nodes.size(), 2u);
  EXPECT_EQ(p.ps_servers, 3);
  EXPECT_EQ(p.num_workers, 4);
  EXPECT_EQ(p.world_size, 7);
  EXPECT_EQ(p.nodes[0].nproc, 4);  // 2 workers + servers 0 and 2
  EXPECT_EQ(p.nodes[0].nservers, 2);
  EXPECT_EQ(p.nodes[1].first_rank, 4);
  EXPECT_EQ(p.nodes[1].nproc, 3);  // 2 workers + server 1
  EXPECT_EQ(p.process_name(1), "rank 1");
  EXPECT_EQ(p.process_name(2), "parameter server 0");
  EXPECT_EQ(p.process_name(3), "parameter server 1");
  EXPECT_EQ(p.process_name(4), "rank 2");
  EXPECT_EQ(p.process_name(6), "parameter server 2");
  EXPECT_EQ(p.process_tag(6), "ps2");
  auto worker = worker_env(p, WorkerSlot{5, 1, 3, 1, {}}, "here:1", 2, "t", 0, {});
  EXPECT_EQ(env_value(worker, "RANK"), "3");
  EXPECT_EQ(env_value(worker, "WORLD_SIZE"), "4");
  EXPECT_EQ(env_value(worker, "LOCAL_RANK"), "1");
  EXPECT_EQ(env_value(worker, "LOCAL_WORLD_SIZE"), "2");
  EXPECT_EQ(env_value(worker, "COHORT_ROLE"), "worker");
  EXPECT_EQ(env_value(worker, "COHORT_ROLE_INDEX"), "3");
  EXPECT_EQ(env_value(worker, "COHORT_PS_MODE"), "stale:2");
  auto server = worker_env(p, WorkerSlot{6, 2, 3, 1, {}}, "here:1", 2, "t", 0, {});
  EXPECT_EQ(env_value(server, "COHORT_ROLE"), "server");
  EXPECT_EQ(env_value(server, "COHORT_ROLE_INDEX"), "2");
  EXPECT_EQ(env_value(server, "COHORT_NUM_SERVERS"), "3");
  EXPECT_EQ(env_value(server, "COHORT_NUM_WORKERS"), "4");
  EXPECT_EQ(env_value(server, "RANK"), "2");
  EXPECT_EQ(env_value(server, "WORLD_SIZE"), "3");
  // The agents on other nodes get the same layout.
  auto back = plan_from_json(plan_to_json(p));
  EXPECT_EQ(back.process_name(6), "parameter server 2");
  EXPECT_EQ(back.ps_mode, "stale:2");

  auto bad = with_program();
  bad.ps = 1;
  bad.ps_server = "both";
  EXPECT_EQ(error_of([&] { build_plan(bad, {}, facts()); }),
            "--ps-server both: expected builtin (cohort ps serve) or program");
  auto mode_env = with_program();
  mode_env.ps = 1;
  EXPECT_EQ(build_plan(mode_env, {{"COHORT_PS_MODE", "bsp"}}, facts()).ps_mode, "bsp");
}

}  // namespace
}  // namespace cohort::launch
