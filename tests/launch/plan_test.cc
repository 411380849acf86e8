// Unit tests of the plan builder: modes, sources, conflicts, worker environment, bindings.
#include <algorithm>

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "launch/plan.h"
#include "launch_test_util.h"

namespace cohort::launch {
namespace {

std::string fake_resolve(const std::string& p) { return "/bin/" + p; }

MachineFacts facts() {
  MachineFacts m;
  m.hostname = "here";
  m.cpu_count = 6;
  m.gpu_count = 0;
  m.resolve_program = &fake_resolve;
  return m;
}

Options with_program() {
  Options o;
  o.program = {"train", "--lr", "0.1"};
  return o;
}

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

TEST(Plan, InsideASlurmAllocationTheNodesAreTheHostsAndSrunStartsTheAgents) {
  // What a batch script on h0 of `sbatch -N 3 --ntasks-per-node=2` sees.
  EnvMap batch = {{"SLURM_JOB_ID", "812"},          {"SLURM_JOB_NODELIST", "h[0-2]"},
                  {"SLURM_TASKS_PER_NODE", "2(x3)"}, {"SLURM_NTASKS_PER_NODE", "2"},
                  {"SLURM_NODEID", "0"},             {"SLURMD_NODENAME", "h0"}};
  MachineFacts here = facts();
  here.hostname = "h0";
  auto p = build_plan(with_program(), batch, here);
  EXPECT_EQ(p.mode, Mode::kFanOut);
  EXPECT_EQ(p.agent_launcher, "srun");
  EXPECT_EQ(p.world_size, 6);
  ASSERT_EQ(p.nodes.size(), 3u);
  EXPECT_TRUE(p.nodes[0].local);
  EXPECT_EQ(p.nodes[2].host, "h2");
  EXPECT_EQ(p.nodes[2].first_rank, 4);
  EXPECT_EQ(p.job_id, "slurm-812");
  EXPECT_EQ(p.master_port, 0);  // the head's store binds port 0: two jobs on a node never collide
  EXPECT_EQ(p.source_of("agent launcher"), "inside a Slurm allocation");
  // -n and --nproc-per-node shape it as they shape a hostfile; --launcher ssh keeps the hosts.
  auto o = with_program();
  o.np = 3;
  EXPECT_EQ(build_plan(o, batch, here).nodes.size(), 2u);
  o = with_program();
  o.launcher = "ssh";
  EXPECT_EQ(build_plan(o, batch, here).agent_launcher, "ssh");
  // An salloc shell on a login node: every node is remote, the head only hosts the store.
  EnvMap salloc = {{"SLURM_JOB_ID", "9"}, {"SLURM_JOB_NODELIST", "n[1-2]"}, {"SLURM_TASKS_PER_NODE", "1(x2)"}};
  auto s = build_plan(with_program(), salloc, facts());
  EXPECT_EQ(s.this_node, -1);
  EXPECT_EQ(s.world_size, 2);
  // Each worker's Slurm task variables are its own place, not the agent step's "0 of 1".
  auto w = worker_env(p, WorkerSlot{3, 1, 2, 1, {}}, "h0:1", 2, "t", 0, batch);
  EXPECT_EQ(env_value(w, "SLURM_PROCID"), "3");
  EXPECT_EQ(env_value(w, "SLURM_LOCALID"), "1");
  EXPECT_EQ(env_value(w, "SLURM_NODEID"), "1");
  EXPECT_EQ(env_value(w, "SLURM_NTASKS"), "6");
  EXPECT_EQ(env_value(worker_env(p, WorkerSlot{3, 1, 2, 1, {}}, "h0:1", 2, "t", 0, {}), "SLURM_PROCID"), "(unset)");
  // A GPU allocation without a task count: one slot per GPU.
  EnvMap gpus = {{"SLURM_JOB_ID", "9"}, {"SLURM_JOB_NODELIST", "g[1-2]"}, {"SLURM_TASKS_PER_NODE", "1(x2)"},
                 {"SLURM_GPUS_PER_NODE", "a100:4"}};
  EXPECT_EQ(build_plan(with_program(), gpus, facts()).world_size, 8);
  // One node, this one: a local job. --nnodes, -H: not the allocation's fan-out.
  EnvMap one = {{"SLURM_JOB_ID", "9"}, {"SLURM_JOB_NODELIST", "h0"}, {"SLURM_TASKS_PER_NODE", "2"},
                {"SLURM_NODEID", "0"}};
  EXPECT_EQ(build_plan(with_program(), one, here).mode, Mode::kLocal);
  o = with_program();
  o.hosts = "a:1,b:1";
  EXPECT_EQ(build_plan(o, batch, here).agent_launcher, "ssh");
  o.launcher = "srun";
  EXPECT_EQ(build_plan(o, batch, here).agent_launcher, "srun");
  // --launcher srun outside Slurm, and a misspelt launcher: one line each.
  EXPECT_EQ(error_of([&] { build_plan(o, {}, facts()); }),
            "--launcher srun: not inside a Slurm allocation (SLURM_JOB_ID is not set); run cohort run in an sbatch "
            "script or an salloc shell");
  o.launcher = "rsh";
  EXPECT_EQ(error_of([&] { build_plan(o, batch, here); }), "--launcher rsh: expected auto, ssh or srun");
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

TEST(Plan, FanOutAssignsRanksBySlot) {
  auto o = with_program();
  o.hosts = "here:2,b:3,c:4";
  o.np = 4;
  auto p = build_plan(o, {}, facts());
  EXPECT_EQ(p.mode, Mode::kFanOut);
  ASSERT_EQ(p.nodes.size(), 2u);  // c gets no worker
  EXPECT_TRUE(p.nodes[0].local);
  EXPECT_EQ(p.this_node, 0);
  EXPECT_EQ(p.nodes[1].host, "b");
  EXPECT_FALSE(p.nodes[1].local);
  EXPECT_EQ(p.nodes[1].first_rank, 2);
  EXPECT_EQ(p.nodes[1].nproc, 2);
  EXPECT_EQ(p.master_addr, "here");
  o.np = 10;
  EXPECT_EQ(error_of([&] { build_plan(o, {}, facts()); }),
            "-n 10 is more than the 9 slots of -H here:2,b:3,c:4 (--oversubscribe places the rest on the same hosts)");
  auto h = with_program();
  h.hostfile = "hosts";
  h.hostfile_text = "x slots=2\ny slots=2\n";
  auto q = build_plan(h, {}, facts());
  EXPECT_EQ(q.world_size, 4);
  EXPECT_EQ(q.this_node, -1);  // this machine is not in the list: the head only supervises
  EXPECT_EQ(q.source_of("hosts"), "--hostfile hosts");
}

// Where each process runs, in mpirun --display-map's order: "a: 0 2 | b: 1 3" (hosts in node order,
// each host's processes in local-index order).
std::string layout(const Plan& p) {
  std::string s;
  for (const auto& n : p.nodes) {
    s += (s.empty() ? "" : " | ") + n.host + ":";
    for (int l = 0; l < n.nproc; ++l) s += " " + std::to_string(n.rank_of(l));
  }
  return s;
}

// mpirun's --map-by node and --rank-by node over -H hosts. Every expected layout below is what Open MPI
// 4.1.4's `mpirun --do-not-launch --display-map --bind-to none ARGS true` printed for the same ARGS.
TEST(Plan, MapByNodeAndRankByNodeDealRanksOverTheHostsAsMpirunDoes) {
  auto placed = [](const std::string& hosts, std::optional<int> np, std::optional<std::string> map_by,
                   std::optional<std::string> rank_by, bool oversubscribe = false) {
    auto o = with_program();
    o.hosts = hosts;
    o.np = np;
    o.map_by = map_by;
    o.rank_by = rank_by;
    o.oversubscribe = oversubscribe;
    return layout(build_plan(o, {}, facts()));
  };
  // --map-by node: round robin over the hosts, the ranks following the mapping.
  EXPECT_EQ(placed("a:2,b:2", 4, "node", {}), "a: 0 2 | b: 1 3");
  EXPECT_EQ(placed("a:4,b:4,c:4", 6, "node", {}), "a: 0 3 | b: 1 4 | c: 2 5");  // man mpirun's example
  EXPECT_EQ(placed("a:2,b:2,c:2", 5, "NODE", {}), "a: 0 3 | b: 1 4 | c: 2");
  EXPECT_EQ(placed("a:2,b:2,c:2", 2, "node", {}), "a: 0 | b: 1");  // c gets none
  // A host whose slots run out sits the next rounds out; the others take what it could not.
  EXPECT_EQ(placed("a:1,b:4,c:2", 6, "node", {}), "a: 0 | b: 1 3 5 | c: 2 4");
  EXPECT_EQ(placed("a:1,b:4,c:4", 9, "node", {}), "a: 0 | b: 1 3 5 7 | c: 2 4 6 8");
  EXPECT_EQ(placed("a:1,b:4,c:4", 8, "node", {}), "a: 0 | b: 1 3 5 7 | c: 2 4 6");
  EXPECT_EQ(placed("a:2,b:3,c:1", 6, "node", {}), "a: 0 3 | b: 1 4 5 | c: 2");
  // Beyond the slots (--oversubscribe) every host takes its even share, slots or not.
  EXPECT_EQ(placed("a:2,b:1", 7, "node", {}, true), "a: 0 2 4 6 | b: 1 3 5");
  EXPECT_EQ(placed("a:2,b:3,c:1", 11, "node", {}, true), "a: 0 3 6 9 | b: 1 4 7 10 | c: 2 5 8");
  // --rank-by node alone: placed by slot (each host's slots in turn), numbered round robin.
  EXPECT_EQ(placed("a:2,b:2", 4, {}, "node"), "a: 0 2 | b: 1 3");
  EXPECT_EQ(placed("a:3,b:1,c:2", 5, {}, "node"), "a: 0 3 4 | b: 1 | c: 2");
  EXPECT_EQ(placed("a:3,b:1,c:1", 3, {}, "node"), "a: 0 1 2");
  EXPECT_EQ(placed("a:2,b:3,c:1", 10, {}, "Node", true), "a: 0 3 6 8 | b: 1 4 7 9 | c: 2 5");
  // --map-by node --rank-by slot: the by-node counts, each host's ranks consecutive.
  EXPECT_EQ(placed("a:3,b:1,c:2", 6, "node", "slot"), "a: 0 1 2 | b: 3 | c: 4 5");
  EXPECT_EQ(placed("a:2,b:2,c:2", {}, "ppr:2:node", "node"), "a: 0 3 | b: 1 4 | c: 2 5");

  // -N 2 with --map-by node: two on every host, dealt round robin.
  auto o = with_program();
  o.hosts = "here,b,c";
  o.nproc_per_node = "2";
  o.nproc_per_node_flag = "-N/--npernode";
  o.map_by = "node";
  o.bind_to = "none";  // the default (auto) depends on this machine's CPUs
  auto p = build_plan(o, {}, facts());
  EXPECT_EQ(layout(p), "here: 0 3 | b: 1 4 | c: 2 5");
  // One accessor answers every question about a node's processes.
  const NodePlan& b = p.nodes[1];
  EXPECT_EQ(b.processes(), (std::vector<int>{1, 4}));
  EXPECT_EQ(b.local_index_of(4), 1);
  EXPECT_EQ(b.local_index_of(2), -1);
  EXPECT_EQ(b.ranks_text(), "1,4");
  EXPECT_EQ(p.node_of_process(4)->host, "b");
  EXPECT_EQ(p.node_of_process(5)->host, "c");
  EXPECT_EQ(p.local_rank_of(3), 1);
  EXPECT_EQ(p.process_name(3), "rank 3");
  // The agents get the dealt ranks with their plan; the dry run shows them with each local worker's variables.
  auto q = plan_from_json(plan_to_json(p));
  EXPECT_EQ(layout(q), layout(p));
  auto text = describe_plan(p, {}, "here:1234");
  EXPECT_NE(text.find("\nnode 1 (b, over ssh): ranks 1,4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 3 (local 1) cpus any: RANK=3 LOCAL_RANK=1 WORLD_SIZE=6 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 "),
            std::string::npos)
      << text;
  // Consecutive ranks keep the usual form (no list), whatever the flags.
  o.map_by = "slot";
  auto slot = build_plan(o, {}, facts());
  EXPECT_EQ(layout(slot), "here: 0 1 | b: 2 3 | c: 4 5");
  for (const auto& n : slot.nodes) EXPECT_TRUE(n.ranks.empty());
  EXPECT_TRUE(build_plan(with_program(), {}, facts()).nodes[0].ranks.empty());
  // A local job is one host: by node is by slot there.
  auto local = with_program();
  local.np = 3;
  local.map_by = "node";
  EXPECT_EQ(layout(build_plan(local, {}, facts())), "here: 0 1 2");

  // What it refuses, in one line each.
  auto bad = with_program();
  bad.rank_by = "core";
  EXPECT_EQ(error_of([&] { build_plan(bad, {}, facts()); }),
            "--rank-by core: cohort numbers ranks by slot (each host's processes in turn) or by node (round robin over "
            "the hosts); supported: slot, node");
  bad = with_program();
  bad.hosts = "a:2,b:2";
  bad.rank_by = "node";
  bad.ps = 1;
  EXPECT_EQ(error_of([&] { build_plan(bad, {}, facts()); }),
            "--rank-by node and --ps both given: a parameter-server job keeps each node's processes consecutive (its "
            "workers, then its servers); use --rank-by slot");
  bad = with_program();
  bad.nnodes = 2;
  bad.node_rank = 0;
  bad.master_addr = "m";
  bad.map_by = "node";
  EXPECT_EQ(error_of([&] { build_plan(bad, {}, facts()); }),
            "--map-by node: each node of a per-node job (--nnodes) starts its own ranks, numbered consecutively; ranks "
            "are dealt over the hosts when one cohort run starts them all (-H, --hostfile)");
}

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

// Ray mode with the seed's environment: TI-ONE gives every node HEAD_ADDR, HEAD_PORT and RANK (0: the
// head), and the node count some other way (here --nnodes, or WORLD_SIZE).
TEST(Plan, RayJobFromTionesHeadAddrHeadPortAndRank) {
  const EnvMap tione{{"HEAD_ADDR", "train-head-0"}, {"HEAD_PORT", "6379"}, {"RANK", "2"}};
  auto o = with_program();
  o.ray = true;
  o.nnodes = 4;
  auto p = build_plan(o, tione, facts());
  EXPECT_EQ(p.mode, Mode::kPerNode);
  EXPECT_EQ(p.nnodes, 4);
  EXPECT_EQ(p.this_node, 2);
  EXPECT_EQ(p.source_of("node rank"), "RANK");
  EXPECT_EQ(p.master_addr, "train-head-0");  // node 0, the Ray head, hosts the job's store too
  EXPECT_EQ(p.source_of("store address"), "HEAD_ADDR (node 0: the Ray head hosts the job's store too)");
  EXPECT_EQ(p.master_port, 29500);
  EXPECT_TRUE(p.ray.enabled);
  EXPECT_EQ(p.ray.head_port, 6379);
  EXPECT_EQ(p.ray.head_port_source, "HEAD_PORT");
  EXPECT_EQ(p.ray.head_address, "train-head-0");
  EXPECT_NE(std::find(p.schedulers.begin(), p.schedulers.end(), "TI-ONE (Ray)"), p.schedulers.end());
  // One Ray node on each node, the driver beside node 0's.
  ASSERT_EQ(p.nodes.size(), 4u);
  EXPECT_EQ(p.nodes[0].nproc, 2);
  EXPECT_EQ(p.nodes[1].first_rank, 2);
  EXPECT_EQ(p.nodes[3].first_rank, 4);
  EXPECT_EQ(p.nodes[3].nproc, 1);
  EXPECT_EQ(p.world_size, 5);
  EXPECT_EQ(p.process_name(0), "the Ray head (node 0)");
  EXPECT_EQ(p.process_name(1), "the driver");
  EXPECT_EQ(p.process_name(4), "Ray node 3");
  EXPECT_EQ(p.process_tag(1), "driver");
  EXPECT_EQ(p.process_tag(3), "ray2");
  EXPECT_TRUE(p.is_ray_driver(1));
  EXPECT_FALSE(p.is_ray_driver(0));
  // Ray places its own workers: no binding, no OMP_NUM_THREADS, no flight recorder.
  EXPECT_EQ(p.bind_to, "none");
  EXPECT_FALSE(p.set_omp_threads);
  EXPECT_EQ(p.flight_recorder, 0);
  EXPECT_TRUE(p.tag_output);
  // Only node 0 runs the driver: the other nodes do not look for PROGRAM, they look for `ray`.
  EXPECT_EQ(p.ray.command_path, "/bin/ray");
  EXPECT_EQ(p.program_path, "train");

  // --ray-port wins over HEAD_PORT; WORLD_SIZE gives the node count as well as --nnodes.
  auto w = with_program();
  w.ray = true;
  w.ray_port = 6380;
  EnvMap counted = tione;
  counted["WORLD_SIZE"] = "4";
  auto q = build_plan(w, counted, facts());
  EXPECT_EQ(q.nnodes, 4);
  EXPECT_EQ(q.ray.head_port, 6380);
  EXPECT_EQ(q.ray.head_port_source, "--ray-port");
  // The three variables alone (as TI-ONE sets them): no node count. Node 2 knows of the head and of itself,
  // and joins the head's store and cluster whenever it starts; node 0 hosts the store even as the only node
  // it knows of (not a local job on loopback: the others must reach it).
  auto bare = with_program();
  bare.ray = true;
  auto node2_alone = build_plan(bare, tione, facts());
  EXPECT_TRUE(node2_alone.ray.open_membership);
  EXPECT_EQ(node2_alone.mode, Mode::kPerNode);
  EXPECT_EQ(node2_alone.nnodes, 3);
  EXPECT_EQ(node2_alone.this_node, 2);
  EXPECT_FALSE(node2_alone.host_store);
  EXPECT_EQ(node2_alone.master_addr, "train-head-0");
  EXPECT_EQ(node2_alone.source_of("nnodes"),
            "none given (HEAD_ADDR, HEAD_PORT and RANK alone): the other nodes join the Ray head as they start");
  EnvMap head_env = tione;
  head_env["RANK"] = "0";
  auto head_alone = build_plan(bare, head_env, facts());
  EXPECT_TRUE(head_alone.ray.open_membership);
  EXPECT_EQ(head_alone.mode, Mode::kPerNode);
  EXPECT_EQ(head_alone.nnodes, 1);
  EXPECT_TRUE(head_alone.host_store);
  EXPECT_EQ(head_alone.master_addr, "train-head-0");
  EXPECT_EQ(head_alone.nodes[0].nproc, 2);  // its Ray head and the driver
  EXPECT_TRUE(plan_from_json(plan_to_json(head_alone)).ray.open_membership);
  // A count, from --nnodes or the environment, is waited for in full as before.
  EXPECT_FALSE(p.ray.open_membership);
  EXPECT_FALSE(q.ray.open_membership);
  // A job that is not a Ray job does not take the Ray head for its store.
  auto plain = with_program();
  EXPECT_EQ(error_of([&] { build_plan(plain, counted, facts()); }),
            "--nnodes 4 needs --master-addr (the address of node 0) or MASTER_ADDR");

  // What each process gets: TI-ONE's three variables, and RAY_ADDRESS for the driver; not torchrun's.
  auto head = build_plan(o, {{"HEAD_ADDR", "train-head-0"}, {"HEAD_PORT", "6379"}, {"RANK", "0"}}, facts());
  auto driver = worker_env(head, WorkerSlot{1, 1, 2, 0, {}, "10.0.0.1:6379"}, "train-head-0:29500", 0, "t", 0, {});
  EXPECT_EQ(env_value(driver, "HEAD_ADDR"), "train-head-0");
  EXPECT_EQ(env_value(driver, "HEAD_PORT"), "6379");
  EXPECT_EQ(env_value(driver, "RANK"), "0");
  EXPECT_EQ(env_value(driver, "RAY_ADDRESS"), "10.0.0.1:6379");
  EXPECT_EQ(env_value(driver, "WORLD_SIZE"), "(unset)");
  EXPECT_EQ(env_value(driver, "MASTER_ADDR"), "(unset)");
  auto node2 = worker_env(p, WorkerSlot{3, 0, 1, 2, {}, "10.0.0.1:6379"}, "train-head-0:29500", 0, "t", 0, {});
  EXPECT_EQ(env_value(node2, "RANK"), "2");
  EXPECT_EQ(env_value(node2, "RAY_ADDRESS"), "(unset)");
  EXPECT_EQ(ray_node_argv(p, 2, "10.0.0.3", "10.0.0.1:6379", ray_ports_in(23000, 23999))[3], "10.0.0.1:6379");

  // The agents of a fan-out get the Ray plan with the rest.
  auto back = plan_from_json(plan_to_json(p));
  EXPECT_TRUE(back.ray.enabled);
  EXPECT_EQ(back.ray.head_port, 6379);
  EXPECT_EQ(back.ray.head_address, "train-head-0");
  EXPECT_TRUE(back.is_ray_driver(1));
}

TEST(Plan, RayJobOverHostsAndWhatItRefuses) {
  auto o = with_program();
  o.ray = true;
  o.hosts = "here:8,b:8,c:8";  // slots mean nothing to Ray: one Ray node per host
  o.ray_ports = "40000-40999";
  o.ray_command = "/opt/ray/bin/ray";
  auto p = build_plan(o, {}, facts());
  EXPECT_EQ(p.mode, Mode::kFanOut);
  EXPECT_EQ(p.nnodes, 3);
  EXPECT_EQ(p.world_size, 4);
  EXPECT_EQ(p.this_node, 0);
  EXPECT_EQ(p.ray.head_port, 0);  // picked free by node 0 at start
  EXPECT_EQ(p.ray.first_port, 40000);
  EXPECT_EQ(p.ray.last_port, 40999);
  EXPECT_EQ(p.ray.command_path, "/bin//opt/ray/bin/ray");  // the test's fake PATH lookup

  auto refused = [&](auto change) {
    auto r = with_program();
    r.ray = true;
    r.hosts = "here:1,b:1";
    change(r);
    return error_of([&] { build_plan(r, {}, facts()); });
  };
  EXPECT_EQ(refused([](Options& r) { r.np = 4; }),
            "--ray and -n 4 both given: a Ray job runs one Ray node on each node and the driver once, on node 0; Ray "
            "places the work on its nodes itself (leave it out)");
  EXPECT_NE(refused([](Options& r) { r.nproc_per_node = "2"; }).find("--ray and --nproc-per-node 2 both given"),
            std::string::npos);
  EXPECT_NE(refused([](Options& r) { r.ps = 1; }).find("--ray and --ps both given"), std::string::npos);
  EXPECT_EQ(refused([](Options& r) { r.abort_on_failure = false; }),
            "--ray and --no-abort-on-failure both given: a Ray job ends when its driver ends or a node's Ray is lost");
  EXPECT_NE(refused([](Options& r) { r.bind_to = "core"; }).find("Ray's processes are not bound"), std::string::npos);
  EXPECT_NE(refused([](Options& r) { r.stats = true; }).find("--ray and --stats both given"), std::string::npos);
  EXPECT_NE(refused([](Options& r) { r.ranks_to_console = "0"; }).find("a Ray job has no ranks"), std::string::npos);
  EXPECT_NE(refused([](Options& r) { r.gpu_share = true; }).find("shares them out itself"), std::string::npos);
  EXPECT_EQ(refused([](Options& r) { r.ray_ports = "40000-40010"; }),
            "--ray-ports 40000-40010: expected FIRST-LAST, at least 16 ports between 1024 and 65535");
  EXPECT_NE(refused([](Options& r) { r.ray_ports = "80-2000"; }).find("expected FIRST-LAST"), std::string::npos);
  EXPECT_EQ(refused([](Options& r) { r.ray_port = 70000; }), "--ray-port 70000: expected a port between 1 and 65535");
  auto no_ray = with_program();
  no_ray.ray_port = 6379;
  EXPECT_EQ(error_of([&] { build_plan(no_ray, {}, facts()); }), "--ray-port needs --ray (a Ray job, docs/ray.md)");
  // Elastic membership, from the flag or from Kubeflow's environment.
  auto elastic = with_program();
  elastic.ray = true;
  elastic.nnodes = 3;
  elastic.min_nodes = 1;
  EXPECT_NE(error_of([&] { build_plan(elastic, {}, facts()); }).find("--ray and --nnodes 1:3 both given"),
            std::string::npos);
  auto kubeflow = with_program();
  kubeflow.ray = true;
  EXPECT_NE(error_of([&] {
              build_plan(kubeflow, {{"PET_NNODES", "1:3"}, {"MASTER_ADDR", "m"}}, facts());
            }).find("--ray and an elastic job (PET_NNODES) both given"),
            std::string::npos);
}

TEST(Plan, RayDryRunSaysHowTheClusterComesUp) {
  auto o = with_program();
  o.ray = true;
  o.nnodes = 2;
  const EnvMap tione{{"HEAD_ADDR", "here"}, {"HEAD_PORT", "6379"}, {"RANK", "0"}, {"PYTHONPATH", "/srv"}};
  o.export_env = {"PYTHONPATH"};
  auto p = build_plan(o, tione, facts());
  auto text = describe_plan(p, tione, "here:29500");
  for (const char* want :
       {"  ray             node 0 runs the Ray head; node 1 starts its Ray once the head's GCS answers",
        "the driver runs on node 0 once `ray status` lists every node's Rank:<n> (each wait up to --join-timeout 300 s)",
        "  ray command     ray (here /bin/ray)", "  ray ports       GCS 6379  [HEAD_PORT]; each node's others in ",
        "  scheduler env   torchrun/Kubeflow, TI-ONE (Ray)", "node 0 (here, this machine): the Ray head, then the driver",
        "  the Ray head (node 0) (first): HEAD_ADDR=here HEAD_PORT=6379 RANK=0 PYTHONPATH=/srv",
        "    command: /bin/ray start --head --port 6379 --node-ip-address '<node 0'\\''s address: HEAD_ADDR here, "
        "checked there at start>' --num-cpus ",
        "--resources '{\"Rank:0\": 1}'", "--include-dashboard false --disable-usage-stats --block",
        "  the driver (once every node has joined): HEAD_ADDR=here HEAD_PORT=6379 RANK=0 RAY_ADDRESS=",
        "    command: train --lr 0.1", "node 1 (node1, its own launcher): Ray node 1"})
    EXPECT_NE(text.find(want), std::string::npos) << "missing: " << want << "\n" << text;
  EXPECT_EQ(text.find("nproc per node"), std::string::npos) << text;
  // Without a node count: the head starts the driver once it is up; node 2 names only the head and itself.
  auto bare = with_program();
  bare.ray = true;
  const EnvMap uncounted{{"HEAD_ADDR", "here"}, {"HEAD_PORT", "6379"}, {"RANK", "0"}};
  auto head = describe_plan(build_plan(bare, uncounted, facts()), uncounted, "here:29500");
  for (const char* want :
       {"  nodes           not counted  [none given (HEAD_ADDR, HEAD_PORT and RANK alone)",
        "  ray             node 0 runs the Ray head; the driver runs on node 0 once the head is up (`ray status` lists "
        "its Rank:0); the job does not count its nodes: each other node starts its Ray when it starts",
        "  the driver (once the head is up): HEAD_ADDR=here HEAD_PORT=6379 RANK=0 RAY_ADDRESS="})
    EXPECT_NE(head.find(want), std::string::npos) << "missing: " << want << "\n" << head;
  EnvMap node2_env = uncounted;
  node2_env["RANK"] = "2";
  node2_env["HEAD_ADDR"] = "elsewhere";
  auto node2 = describe_plan(build_plan(bare, node2_env, facts()), node2_env, "elsewhere:29500");
  EXPECT_NE(node2.find("node 2 (here, this machine): Ray node 2"), std::string::npos) << node2;
  EXPECT_NE(node2.find("node 0 (node0, its own launcher): the Ray head, then the driver"), std::string::npos) << node2;
  EXPECT_EQ(node2.find("node 1 ("), std::string::npos) << node2;
  // Not a Ray job: the Ray variables are not used, and the plan says so.
  auto plain = with_program();
  auto local = describe_plan(build_plan(plain, {{"HEAD_ADDR", "x"}}, facts()), {{"HEAD_ADDR", "x"}}, "127.0.0.1:1");
  EXPECT_NE(local.find("HEAD_ADDR/HEAD_PORT (TI-ONE's Ray mode) are read by --ray jobs only"), std::string::npos)
      << local;
}

}  // namespace
}  // namespace cohort::launch
