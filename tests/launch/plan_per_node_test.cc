// Unit tests of placement by one launcher per node (src/launch/plan_per_node.cc): flags and the
// schedulers' environments (Slurm steps, Kubeflow, TI-ONE, torchrun's variables), a shell's leftover
// rank variables, and the elastic rendezvous of torchrun's multi-node line.

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "launch/plan.h"
#include "launch_test_util.h"
#include "plan_test_util.h"

namespace cohort::launch {
namespace {

TEST(Plan, PerNodeFromFlagsAndScheduler) {
  auto o = with_program();
  o.nnodes = 3;
  o.node_rank = 1;
  o.master_addr = "10.0.0.1";
  o.nproc_per_node = "2";
  auto p = build_plan(o, {}, facts());
  EXPECT_EQ(p.mode, Mode::kPerNode);
  EXPECT_EQ(p.world_size, 6);
  EXPECT_EQ(p.master_port, 29500);
  EXPECT_FALSE(p.host_store);
  EXPECT_EQ(p.nodes[1].first_rank, 2);
  EXPECT_EQ(p.job_id, "job-10.0.0.1-29500");
  // Flags win over the environment; the environment fills the rest.
  auto s = build_plan(with_program(),
                      {{"SLURM_JOB_NODELIST", "n[1-2]"}, {"SLURM_NODEID", "0"}, {"SLURM_NTASKS_PER_NODE", "3"}},
                      facts());
  EXPECT_EQ(s.mode, Mode::kPerNode);
  EXPECT_EQ(s.nnodes, 2);
  EXPECT_EQ(s.master_addr, "n1");
  EXPECT_TRUE(s.host_store);
  EXPECT_EQ(s.world_size, 6);
  EXPECT_EQ(s.source_of("nproc per node"), "SLURM_NTASKS_PER_NODE");
  EXPECT_EQ(s.source_of("store address"), "SLURM_JOB_NODELIST (first node)");
  EXPECT_EQ(s.schedulers, std::vector<std::string>{"Slurm"});
  auto f = with_program();
  f.nnodes = 1;  // --nnodes given: the scheduler environment is not consulted
  EXPECT_EQ(build_plan(f, {{"WORLD_SIZE", "4"}, {"RANK", "9"}}, facts()).mode, Mode::kLocal);
}


TEST(Plan, AnExplicitLocalShapeIgnoresAShellsLeftoverRankVariables) {
  // What a shell keeps after `export MASTER_ADDR=127.0.0.1 MASTER_PORT=29592 WORLD_SIZE=2 RANK=0` for a
  // DDP script run by hand (issue 46): with -n 2 this is a local job, as torchrun makes it.
  const EnvMap leftovers = {{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29592"}};
  auto n = with_program();
  n.np = 2;
  auto p = build_plan(n, leftovers, facts());
  EXPECT_EQ(p.mode, Mode::kLocal);
  EXPECT_EQ(p.world_size, 2);
  EXPECT_EQ(p.master_port, 0);  // the leftover MASTER_PORT is not the store's port either
  EXPECT_EQ(p.source_of("nnodes"), "default");
  EXPECT_TRUE(p.schedulers.empty());
  ASSERT_EQ(p.notes.size(), 1u);
  EXPECT_EQ(p.notes[0],
            "ignoring MASTER_ADDR=127.0.0.1 MASTER_PORT=29592 WORLD_SIZE=2 RANK=0 from the environment: -n 2 without "
            "--nnodes is a job on this machine (as with torchrun), and no platform's variables (Slurm's, Kubeflow's "
            "PET_*, TI-ONE's NODE_LIST, ...) came with them; for a job of several nodes give --nnodes and --node-rank");
  EXPECT_NE(describe_plan(p, leftovers, "127.0.0.1:1").find("\n  note            ignoring MASTER_ADDR=127.0.0.1 "),
            std::string::npos);
  // --nproc-per-node (and mpirun's -N, --map-by ppr:N:node) give the shape as well; contradictory
  // leftovers (RANK beyond WORLD_SIZE) are ignored rather than refused.
  auto g = with_program();
  g.nproc_per_node = "2";
  auto q = build_plan(g, {{"WORLD_SIZE", "2"}, {"RANK", "5"}}, facts());
  EXPECT_EQ(q.mode, Mode::kLocal);
  ASSERT_EQ(q.notes.size(), 1u);
  EXPECT_EQ(q.notes[0].find("ignoring WORLD_SIZE=2 RANK=5 from the environment: --nproc-per-node 2 without"), 0u)
      << q.notes[0];
  auto m = with_program();
  m.map_by = "ppr:2:node";
  EXPECT_EQ(build_plan(m, leftovers, facts()).mode, Mode::kLocal);
  // Nothing to ignore, nothing said.
  EXPECT_TRUE(build_plan(n, {}, facts()).notes.empty());

  // No shape on the command line: the variables place the job as before (torchrun / Kubeflow's first operators).
  auto bare = build_plan(with_program(), leftovers, facts());
  EXPECT_EQ(bare.mode, Mode::kPerNode);
  EXPECT_EQ(bare.nnodes, 2);
  EXPECT_TRUE(bare.notes.empty());
  // --nnodes or --node-rank: a job of nodes meant; the environment fills what they leave open, as before.
  auto ranked = with_program();
  ranked.np = 2;
  ranked.node_rank = 1;
  auto r = build_plan(ranked, leftovers, facts());
  EXPECT_EQ(r.mode, Mode::kPerNode);
  EXPECT_EQ(r.source_of("store address"), "MASTER_ADDR");

  // A platform's complete environment still places the job: Kubeflow's PyTorchJob (PET_* beside the four),
  // a Slurm step, TI-ONE's NODE_LIST/INDEX.
  EnvMap kubeflow = leftovers;
  kubeflow["PET_NNODES"] = "2";
  kubeflow["PET_NODE_RANK"] = "0";
  auto k = build_plan(g, kubeflow, facts());
  EXPECT_EQ(k.mode, Mode::kPerNode);
  EXPECT_EQ(k.world_size, 4);
  EXPECT_EQ(k.master_port, 29592);
  EXPECT_TRUE(k.notes.empty());
  auto slurm = build_plan(g, {{"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NODELIST", "n[1-2]"}, {"SLURMD_NODENAME", "n2"},
                              {"SLURM_JOB_ID", "7"}, {"MASTER_PORT", "29592"}},
                          facts());
  EXPECT_EQ(slurm.mode, Mode::kPerNode);
  EXPECT_EQ(slurm.this_node, 1);
  EXPECT_EQ(slurm.master_port, 29592);
  auto tione = build_plan(g, {{"NODE_LIST", "10.0.0.1:2,10.0.0.2:2"}, {"INDEX", "1"}, {"MASTER_PORT", "29592"}}, facts());
  EXPECT_EQ(tione.mode, Mode::kPerNode);
  EXPECT_EQ(tione.master_addr, "10.0.0.1");
  EXPECT_EQ(tione.this_node, 1);
  EXPECT_EQ(tione.master_port, 29592);
}


TEST(Plan, AnSrunStepIsOneNodeOfAPerNodeJob) {
  // `srun --ntasks=3 --ntasks-per-node=1 cohort run --nproc-per-node 2 prog`, seen on h2 (a step on
  // nodes h1-h3 of a job on h0-h3: SLURM_NODEID counts the job's nodes, the step's list decides).
  EnvMap step = {{"SLURM_JOB_ID", "1234"},           {"SLURM_STEP_ID", "5"},
                 {"SLURM_JOB_NODELIST", "h[0-3]"},   {"SLURM_STEP_NODELIST", "h[1-3]"},
                 {"SLURM_STEP_TASKS_PER_NODE", "1(x3)"}, {"SLURM_NODEID", "2"},
                 {"SLURMD_NODENAME", "h2"},          {"SLURM_NTASKS_PER_NODE", "1"}};
  auto o = with_program();
  o.nproc_per_node = "2";
  auto p = build_plan(o, step, facts());
  EXPECT_EQ(p.mode, Mode::kPerNode);
  EXPECT_EQ(p.nnodes, 3);
  EXPECT_EQ(p.this_node, 1);
  EXPECT_EQ(p.world_size, 6);
  EXPECT_EQ(p.master_addr, "h1");
  EXPECT_EQ(p.master_port, 20000 + 234 * 10 + 5);
  EXPECT_EQ(p.job_id, "slurm-1234.5");
  EXPECT_EQ(p.source_of("node rank"), "SLURMD_NODENAME in SLURM_STEP_NODELIST");
  // MASTER_PORT set in the batch script wins over the derived port.
  step["MASTER_PORT"] = "29999";
  EXPECT_EQ(build_plan(o, step, facts()).master_port, 29999);
  step.erase("MASTER_PORT");
  // Elastic: --nnodes MIN:MAX, and Slurm still says where the store is.
  auto e = with_program();
  e.nnodes = 3;
  e.min_nodes = 2;
  e.nproc_per_node = "2";
  auto el = build_plan(e, step, facts());
  EXPECT_TRUE(el.elastic);
  EXPECT_EQ(el.master_addr, "h1");
  EXPECT_EQ(el.master_port, 20000 + 234 * 10 + 5);
  // srun with the batch job's 2 tasks per node starts two cohorts on a node: refused, saying what to write.
  step["SLURM_STEP_TASKS_PER_NODE"] = "2(x3)";
  EXPECT_EQ(error_of([&] { build_plan(o, step, facts()); }),
            "srun started 2 cohort launchers on node h2 (SLURM_STEP_TASKS_PER_NODE=2(x3)); cohort run starts the "
            "node's workers itself and wants one launcher per node: srun --ntasks=3 --ntasks-per-node=1 cohort run "
            "... (or run cohort run once, without srun, in the batch script)");
  step["SLURM_STEP_TASKS_PER_NODE"] = "1(x3)";
  step["SLURMD_NODENAME"] = "h0";
  EXPECT_EQ(error_of([&] { build_plan(o, step, facts()); }), "SLURMD_NODENAME=h0 is not in SLURM_STEP_NODELIST=h[1-3]");
}


TEST(Plan, ElasticFromTheFlagOrFromKubeflowsElasticEnvironment) {
  Options o = with_program();
  o.nnodes = 4;
  o.min_nodes = 2;
  o.master_addr = "here";
  o.nproc_per_node = "2";
  auto p = build_plan(o, {}, facts());
  EXPECT_TRUE(p.elastic);
  EXPECT_EQ(p.min_nodes, 2);
  EXPECT_EQ(p.max_nodes, 4);
  EXPECT_EQ(p.mode, Mode::kPerNode);
  EXPECT_TRUE(p.host_store) << "the master address is this host: its agent hosts the store";
  EXPECT_EQ(p.source_of("elastic"), "--nnodes 2:4");
  // Kubeflow's elastic PyTorchJob: PET_NNODES=MIN:MAX and the rendezvous endpoint.
  auto k = build_plan(with_program(), {{"PET_NNODES", "1:3"}, {"PET_RDZV_ENDPOINT", "w0:29400"}, {"PET_NPROC_PER_NODE", "2"}},
                      facts());
  EXPECT_TRUE(k.elastic);
  EXPECT_EQ(k.min_nodes, 1);
  EXPECT_EQ(k.max_nodes, 3);
  EXPECT_EQ(k.master_addr, "w0");
  EXPECT_EQ(k.master_port, 29400);
  EXPECT_FALSE(k.host_store) << "w0 is another host";
  EXPECT_EQ(k.source_of("elastic"), "PET_NNODES");
  // A fixed PET_NNODES stays a static job.
  EXPECT_FALSE(build_plan(with_program(), {{"PET_NNODES", "3"}, {"MASTER_ADDR", "w0"}}, facts()).elastic);
}


TEST(Plan, TorchrunsMultiNodeLineWithoutANodeRankGetsItsNodeRanksAtTheRendezvous) {
  // --nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=w0:29418, the same on every node.
  Options o = with_program();
  o.nnodes = 2;
  o.master_addr = "w0";
  o.master_port = 29418;
  o.rdzv_endpoint = true;
  o.rdzv_backend = "c10d";
  auto p = build_plan(o, {}, facts());
  EXPECT_TRUE(p.elastic);
  EXPECT_EQ(p.min_nodes, 2);
  EXPECT_EQ(p.max_nodes, 2);
  EXPECT_EQ(p.source_of("node rank"), "the rendezvous, at each generation");
  EXPECT_EQ(p.source_of("elastic"),
            "--nnodes 2 with --rdzv-endpoint and no --node-rank: node ranks are assigned at the rendezvous");
  // --rdzv-backend c10d alone, with --master-addr, does the same.
  Options c = o;
  c.rdzv_endpoint = false;
  EXPECT_TRUE(build_plan(c, {}, facts()).elastic);
  // A node rank from the flag or a scheduler, the static backend, or neither endpoint nor c10d: the
  // fixed per-node layout, as before.
  Options ranked = o;
  ranked.node_rank = 1;
  EXPECT_FALSE(build_plan(ranked, {}, facts()).elastic);
  Options fixed = o;
  fixed.rdzv_backend = "static";
  EXPECT_FALSE(build_plan(fixed, {}, facts()).elastic);
  Options plain = o;
  plain.rdzv_endpoint = false;
  plain.rdzv_backend.reset();
  EXPECT_FALSE(build_plan(plain, {}, facts()).elastic);
  Options srun = o;
  auto in_step = build_plan(srun, {{"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NODELIST", "w[0-1]"}, {"SLURM_NODEID", "1"},
                                   {"SLURM_JOB_NODELIST", "w[0-1]"}, {"SLURM_NNODES", "2"}},
                            facts());
  EXPECT_FALSE(in_step.elastic) << "Slurm says which node this is";
}

}  // namespace
}  // namespace cohort::launch
