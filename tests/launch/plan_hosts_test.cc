// Unit tests of placement by one launcher that starts every host (src/launch/plan_hosts.cc): a Slurm
// allocation's nodes, -H's slots, and mpirun's --map-by / --rank-by over them.
#include <optional>

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "launch/plan.h"
#include "launch_test_util.h"
#include "plan_test_util.h"

namespace cohort::launch {
namespace {

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

}  // namespace
}  // namespace cohort::launch
