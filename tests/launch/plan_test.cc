// Unit tests of the plan builder that hold for every placement source: a local job's defaults, the
// refusals, the workers' environment, bindings and the plan's JSON and dry-run text. Each placement
// source has its own file: plan_per_node_test.cc, plan_hosts_test.cc, plan_ps_test.cc, plan_ray_test.cc.

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "launch/plan.h"
#include "launch_test_util.h"
#include "plan_test_util.h"

namespace cohort::launch {
namespace {

TEST(Plan, LocalDefaultsToOneWorkerAndOsPort) {
  auto p = build_plan(with_program(), {}, facts());
  EXPECT_EQ(p.mode, Mode::kLocal);
  EXPECT_EQ(p.world_size, 1);
  EXPECT_EQ(p.master_port, 0);
  EXPECT_EQ(p.master_addr, "127.0.0.1");
  EXPECT_EQ(p.program_path, "/bin/train");
  EXPECT_EQ(p.program, (std::vector<std::string>{"train", "--lr", "0.1"}));
  EXPECT_FALSE(p.tag_output);
  EXPECT_FALSE(p.set_omp_threads);
  EXPECT_EQ(p.source_of("nproc per node"), "default");
}


TEST(Plan, NprocAutoAndNp) {
  auto o = with_program();
  o.nproc_per_node = "auto";
  auto p = build_plan(o, {}, facts());
  EXPECT_EQ(p.world_size, 6);
  EXPECT_EQ(p.source_of("nproc per node"), "--nproc-per-node (auto: 6 CPU cores)");
  auto gpus = facts();
  gpus.gpu_count = 2;
  EXPECT_EQ(build_plan(o, {}, gpus).world_size, 2);
  Options n = with_program();
  n.np = 4;
  auto q = build_plan(n, {}, facts());
  EXPECT_EQ(q.world_size, 4);
  EXPECT_TRUE(q.tag_output);
  EXPECT_TRUE(q.set_omp_threads);
  EXPECT_FALSE(build_plan(n, {{"OMP_NUM_THREADS", "4"}}, facts()).set_omp_threads);
  n.nproc_per_node = "3";
  EXPECT_EQ(error_of([&] { build_plan(n, {}, facts()); }),
            "-n 4 disagrees with 3 processes per node (--nproc-per-node) on 1 nodes");
}


TEST(Plan, BadInputIsOneLine) {
  auto o = with_program();
  o.nproc_per_node = "0";
  EXPECT_EQ(error_of([&] { build_plan(o, {}, facts()); }), "--nproc-per-node 0: expected a positive number or 'auto'");
  o = with_program();
  o.nnodes = 2;
  o.node_rank = 2;
  o.master_addr = "m";
  EXPECT_EQ(error_of([&] { build_plan(o, {}, facts()); }),
            "node rank 2 (--node-rank) must be below the node count 2 (--nnodes)");
  o = with_program();
  o.nnodes = 2;
  EXPECT_EQ(error_of([&] { build_plan(o, {}, facts()); }),
            "--nnodes 2 needs --master-addr (the address of node 0) or MASTER_ADDR");
  o = with_program();
  o.bind_to = "socket";
  EXPECT_EQ(error_of([&] { build_plan(o, {}, facts()); }), "--bind-to socket: expected auto, none, core or numa");
  o = with_program();
  o.hosts = "a:1";
  o.hostfile = "f";
  EXPECT_EQ(error_of([&] { build_plan(o, {}, facts()); }), "both -H and --hostfile given; use one of them");
  o = with_program();
  o.program.clear();
  EXPECT_NE(error_of([&] { build_plan(o, {}, facts()); }).find("no PROGRAM given"), std::string::npos);
  o = with_program();
  o.export_env = {"NOT_SET_ANYWHERE"};
  EXPECT_EQ(error_of([&] { build_plan(o, {}, facts()); }),
            "-x NOT_SET_ANYWHERE: NOT_SET_ANYWHERE is not set in this environment");
}


TEST(Plan, WorkerEnvironment) {
  auto o = with_program();
  o.nnodes = 2;
  o.node_rank = 1;
  o.master_addr = "m";
  o.nproc_per_node = "2";
  o.max_restarts = 3;
  o.device_per_rank = true;
  o.export_env = {"FOO=bar"};
  auto p = build_plan(o, {}, facts());
  auto env = worker_env(p, WorkerSlot{3, 1, 2, 1, {}}, "m:29500", 40000, "tok", 2, {{"CUDA_VISIBLE_DEVICES", "4,5"}});
  EXPECT_EQ(env_value(env, "RANK"), "3");
  EXPECT_EQ(env_value(env, "LOCAL_RANK"), "1");
  EXPECT_EQ(env_value(env, "WORLD_SIZE"), "4");
  EXPECT_EQ(env_value(env, "LOCAL_WORLD_SIZE"), "2");
  EXPECT_EQ(env_value(env, "GROUP_RANK"), "1");
  EXPECT_EQ(env_value(env, "NODE_RANK"), "1");
  EXPECT_EQ(env_value(env, "MASTER_ADDR"), "m");
  EXPECT_EQ(env_value(env, "MASTER_PORT"), "40000");
  EXPECT_EQ(env_value(env, "TORCHELASTIC_RESTART_COUNT"), "2");
  EXPECT_EQ(env_value(env, "TORCHELASTIC_MAX_RESTARTS"), "3");
  EXPECT_EQ(env_value(env, "TORCHELASTIC_RUN_ID"), p.job_id);
  EXPECT_EQ(env_value(env, "COHORT_STORE_ADDR"), "m:29500");
  EXPECT_EQ(env_value(env, "COHORT_JOB_TOKEN"), "tok");
  EXPECT_EQ(env_value(env, "COHORT_NNODES"), "2");
  EXPECT_EQ(env_value(env, "OMP_NUM_THREADS"), "1");
  EXPECT_EQ(env_value(env, "CUDA_VISIBLE_DEVICES"), "5");
  EXPECT_EQ(env_value(env, "FOO"), "bar");
}


TEST(Plan, Bindings) {
  std::vector<int> cpus{0, 1, 2, 3};
  std::vector<std::vector<int>> numa{{0, 1}, {2, 3}};
  EXPECT_EQ(compute_bindings("none", 2, cpus, numa), (std::vector<std::vector<int>>{{}, {}}));
  EXPECT_EQ(compute_bindings("core", 5, cpus, numa), (std::vector<std::vector<int>>{{0}, {1}, {2}, {3}, {0}}));
  EXPECT_EQ(compute_bindings("numa", 3, cpus, numa), (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {0, 1}}));
  EXPECT_EQ(compute_bindings("numa", 1, {2, 3}, numa), (std::vector<std::vector<int>>{{2, 3}}));
  // auto: equal blocks of whole cores; hyperthread siblings stay together.
  EXPECT_EQ(compute_bindings("auto", 2, cpus, numa), (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
  EXPECT_EQ(compute_bindings("auto", 2, cpus, numa, {{0, 2}, {1, 3}}), (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
  EXPECT_EQ(compute_bindings("auto", 4, cpus, numa, {{0, 2}, {1, 3}}),
            (std::vector<std::vector<int>>{{0}, {2}, {1}, {3}}));  // more ranks than cores: logical CPUs
  EXPECT_EQ(compute_bindings("auto", 3, cpus, numa), (std::vector<std::vector<int>>{{0}, {1}, {2, 3}}));
  EXPECT_EQ(compute_bindings("auto", 1, cpus, numa), (std::vector<std::vector<int>>{{}}));  // one rank: unbound
  EXPECT_EQ(compute_bindings("auto", 5, cpus, numa),
            (std::vector<std::vector<int>>{{}, {}, {}, {}, {}}));  // oversubscribed: unbound
  // The real machine: every allowed CPU is in exactly one core group.
  auto allowed = allowed_cpus();
  size_t grouped = 0;
  for (const auto& core : physical_cores(allowed)) grouped += core.size();
  EXPECT_EQ(grouped, allowed.size());
}


TEST(Plan, JsonRoundTripAndDryRunText) {
  auto o = with_program();
  o.hosts = "here:2,b:2";
  o.ranks_to_console = "0,3";
  o.bind_to = "none";  // the default (auto) depends on this machine's CPUs
  auto p = build_plan(o, {}, facts());
  auto q = plan_from_json(plan_to_json(p));
  EXPECT_EQ(q.nodes.size(), 2u);
  EXPECT_EQ(q.nodes[1].host, "b");
  EXPECT_EQ(q.ranks_to_console, (std::vector<int>{0, 3}));
  EXPECT_EQ(q.program, p.program);
  auto text = describe_plan(p, {}, "here:1234");
  EXPECT_NE(text.find("mode            fan-out"), std::string::npos) << text;
  EXPECT_NE(text.find("[-H here:2,b:2]"), std::string::npos) << text;
  EXPECT_NE(text.find("node 1 (b, over ssh): ranks 2-3"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1 (local 1) cpus any: RANK=1 "), std::string::npos) << text;
  EXPECT_EQ(random_token().size(), 64u);
}

}  // namespace
}  // namespace cohort::launch
