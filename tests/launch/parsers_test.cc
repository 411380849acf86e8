// Unit tests of the launcher's pure parsers: hostfiles, -H lists, Slurm node lists, TF_CONFIG and
// the scheduler/platform variables.
#include <algorithm>

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "launch/parsers.h"
#include "launch_test_util.h"

namespace cohort::launch {
namespace {

TEST(Hostfile, OpenMpiAndDeepSpeedForms) {
  auto hosts = parse_hostfile(
      "# cluster\n"
      "node1 slots=4 max_slots=8\n"
      "\n"
      "node2\tslots=2   # trailing comment\n"
      "node3 slots:3\n"
      "node4\n"
      "node1 slots=2\n",
      "hosts.txt");
  ASSERT_EQ(hosts.size(), 4u);
  EXPECT_EQ(hosts[0], (HostSlots{"node1", 6, 8}));  // repeated host adds slots
  EXPECT_EQ(hosts[1], (HostSlots{"node2", 2, 0}));
  EXPECT_EQ(hosts[2], (HostSlots{"node3", 3, 0}));
  EXPECT_EQ(hosts[3], (HostSlots{"node4", 1, 0}));
}

TEST(Hostfile, ErrorsNameFileAndLine) {
  EXPECT_EQ(error_of([] { parse_hostfile("a slots=2\nb slots=0\n", "h.txt"); }),
            "h.txt:2: slots=0: expected a positive number of slots");
  EXPECT_EQ(error_of([] { parse_hostfile("a slots=x\n", "h.txt"); }),
            "h.txt:1: slots=x: expected a positive number of slots");
  EXPECT_EQ(error_of([] { parse_hostfile("\n\na cpus=2\n", "h.txt"); }),
            "h.txt:3: unknown field 'cpus' (expected slots=N or max_slots=M)");
  EXPECT_EQ(error_of([] { parse_hostfile("a slots=4 max_slots=2\n", "h.txt"); }),
            "h.txt:1: max_slots=2 is smaller than slots=4");
  EXPECT_EQ(error_of([] { parse_hostfile("a junk\n", "h.txt"); }), "h.txt:1: 'junk': expected slots=N or max_slots=M");
  EXPECT_EQ(error_of([] { parse_hostfile("# nothing\n\n", "h.txt"); }), "h.txt: no hosts (only comments or blank lines)");
  EXPECT_EQ(error_of([] { parse_hostfile("slots=2\n", "h.txt"); }),
            "h.txt:1: 'slots=2': expected a host name first, then slots=N");
}

// A line that is no hostfile line blames its first word, the would-be host name, and says what a
// line looks like; a name with characters no host name has is refused, in hostfiles and -H alike.
TEST(Hostfile, ALineOfWordsBlamesTheHostNameNotTheSecondWord) {
  EXPECT_EQ(error_of([] { parse_hostfile("good slots=2\n!!bad line here\n", "h.txt"); }),
            "h.txt:2: '!!bad' is not a host name ('!' cannot appear in one); expected lines of 'HOST [slots=N] "
            "[max_slots=M]'");
  EXPECT_EQ(error_of([] { parse_hostfile("!!bad\n", "h.txt"); }),
            "h.txt:1: '!!bad' is not a host name ('!' cannot appear in one); expected lines of 'HOST [slots=N] "
            "[max_slots=M]'");
  EXPECT_EQ(error_of([] { parse_hostfile("-n slots=2\n", "h.txt"); }),
            "h.txt:1: '-n' is not a host name (it starts with '-'); expected lines of 'HOST [slots=N] [max_slots=M]'");
  EXPECT_EQ(error_of([] { parse_host_list("a:2,b$c:1"); }), "-H 'b$c:1': 'b$c' is not a host name ('$' cannot appear in one)");
  // What real clusters write still parses: names with '-', '_', '.', IPv4, IPv6, MPICH's host:N.
  auto hosts = parse_hostfile("gpu-node_01.cluster.local slots=8\n10.0.0.7\nfe80::1%eth0 slots=2\nnode9:4\n[::1]:3\n",
                              "h.txt");
  ASSERT_EQ(hosts.size(), 5u);
  EXPECT_EQ(hosts[0], (HostSlots{"gpu-node_01.cluster.local", 8, 0}));
  EXPECT_EQ(hosts[1], (HostSlots{"10.0.0.7", 1, 0}));
  EXPECT_EQ(hosts[2], (HostSlots{"fe80::1%eth0", 2, 0}));
  EXPECT_EQ(hosts[3], (HostSlots{"node9", 4, 0}));
  EXPECT_EQ(hosts[4], (HostSlots{"::1", 3, 0}));
}

TEST(HostList, CountsDefaultsAndRepeats) {
  auto hosts = parse_host_list("a:8,b,a:2,[::1]:3,10.0.0.2:1");
  ASSERT_EQ(hosts.size(), 4u);
  EXPECT_EQ(hosts[0], (HostSlots{"a", 10, 0}));
  EXPECT_EQ(hosts[1], (HostSlots{"b", 1, 0}));
  EXPECT_EQ(hosts[2], (HostSlots{"::1", 3, 0}));
  EXPECT_EQ(hosts[3], (HostSlots{"10.0.0.2", 1, 0}));
  EXPECT_EQ(error_of([] { parse_host_list("a:0"); }), "-H 'a:0': slot count '0' must be a positive number");
  EXPECT_EQ(error_of([] { parse_host_list("a:2,,b"); }), "-H 'a:2,,b': empty host name");
  EXPECT_EQ(error_of([] { parse_host_list("::1:2"); }), "-H '::1:2': write an IPv6 address as [addr]:N");
}

TEST(SlurmNodelist, RangesPaddingAndGroups) {
  EXPECT_EQ(expand_slurm_nodelist("node[01-04,07]"),
            (std::vector<std::string>{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expand_slurm_nodelist("gpu7"), (std::vector<std::string>{"gpu7"}));
  EXPECT_EQ(expand_slurm_nodelist("a[1-2],b,c[9-10]"), (std::vector<std::string>{"a1", "a2", "b", "c9", "c10"}));
  EXPECT_EQ(expand_slurm_nodelist("r[1-2]-n[1-2]"), (std::vector<std::string>{"r1-n1", "r1-n2", "r2-n1", "r2-n2"}));
  EXPECT_NE(error_of([] { expand_slurm_nodelist("node[01-"); }).find("unclosed '['"), std::string::npos);
  EXPECT_NE(error_of([] { expand_slurm_nodelist("node[4-2]"); }).find("'4-2'"), std::string::npos);
  EXPECT_EQ(expand_slurm_counts("2(x3),1", "SLURM_TASKS_PER_NODE"), (std::vector<int>{2, 2, 2, 1}));
}

TEST(TfConfig, WorkerAndChief) {
  auto w = parse_tf_config(R"({"cluster":{"worker":["h0:2222","h1:2222","h2:2222"]},"task":{"type":"worker","index":2}})");
  EXPECT_EQ(w.nodes.size(), 3u);
  EXPECT_EQ(w.node_rank, 2);
  auto c = parse_tf_config(R"({"cluster":{"chief":["c:1"],"worker":["w0:1","w1:1"]},"task":{"type":"worker","index":1}})");
  EXPECT_EQ(c.nodes, (std::vector<std::string>{"c:1", "w0:1", "w1:1"}));
  EXPECT_EQ(c.node_rank, 2);
  EXPECT_EQ(parse_tf_config(R"({"cluster":{"chief":["c:1"],"worker":["w0:1"]},"task":{"type":"chief","index":0}})")
                .node_rank,
            0);
  EXPECT_NE(error_of([] { parse_tf_config("{not json"); }).find("TF_CONFIG: not valid JSON"), std::string::npos);
  EXPECT_EQ(error_of([] { parse_tf_config(R"({"cluster":{"worker":["a:1"]},"task":{"type":"ps","index":0}})"); }),
            "TF_CONFIG: task ps index 0 is outside cluster.ps (0 entries)");
  EXPECT_EQ(
      error_of([] { parse_tf_config(R"({"cluster":{"worker":["a:1"]},"task":{"type":"evaluator","index":0}})"); }),
      "TF_CONFIG: task.type 'evaluator' is not launched by cohort (expected chief, worker or ps)");
  EXPECT_EQ(error_of([] { parse_tf_config(R"({"cluster":{"worker":["a:1"]},"task":{"type":"worker","index":3}})"); }),
            "TF_CONFIG: task worker index 3 is outside cluster.worker (1 entries)");
}

// Parameter-server clusters (docs/parameter-server.md): ps entries are nodes after the workers.
TEST(TfConfig, PsEntriesAreServerNodesAfterTheWorkers) {
  auto ps = parse_tf_config(
      R"({"cluster":{"chief":["c:1"],"worker":["w0:1"],"ps":["p0:1","p1:1"]},"task":{"type":"ps","index":1}})");
  EXPECT_EQ(ps.nodes, (std::vector<std::string>{"c:1", "w0:1", "p0:1", "p1:1"}));
  EXPECT_EQ(ps.ps_nodes, 2);
  EXPECT_EQ(ps.node_rank, 3);
  auto w = parse_tf_config(R"({"cluster":{"worker":["w0:1","w1:1"],"ps":["p0:1"]},"task":{"type":"worker","index":1}})");
  EXPECT_EQ(w.node_rank, 1);
  EXPECT_EQ(w.ps_nodes, 1);
  EXPECT_EQ(error_of([] { parse_tf_config(R"({"cluster":{"worker":["a:1"],"ps":["p:1"]},"task":{"type":"ps","index":1}})"); }),
            "TF_CONFIG: task ps index 1 is outside cluster.ps (1 entries)");
  EXPECT_EQ(error_of([] { parse_tf_config(R"({"cluster":{"worker":["a:1"],"ps":[7]},"task":{"type":"worker"}})"); }),
            "TF_CONFIG: cluster.ps must be a list of \"host:port\"");
  auto info = read_scheduler_env(
      {{"TF_CONFIG", R"({"cluster":{"worker":["w0:1","w1:1"],"ps":["p0:1"]},"task":{"type":"ps","index":0}})"}});
  ASSERT_TRUE(info.ps_nodes);
  EXPECT_EQ(info.ps_nodes->value, 1);
  EXPECT_EQ(info.nnodes->value, 3);
  EXPECT_EQ(info.node_rank->value, 2);
}

TEST(SchedulerEnv, Slurm) {
  auto info = read_scheduler_env({{"SLURM_JOB_NODELIST", "gpu[03-06]"},
                                  {"SLURM_NNODES", "4"},
                                  {"SLURM_NODEID", "2"},
                                  {"SLURM_GPUS_ON_NODE", "8"},
                                  {"SLURM_JOB_ID", "777"}});
  EXPECT_EQ(info.nnodes->value, 4);
  EXPECT_EQ(info.nnodes->source, "SLURM_NNODES");
  EXPECT_EQ(info.node_rank->value, 2);
  EXPECT_EQ(info.master_addr->value, "gpu03");
  EXPECT_EQ(info.nproc_per_node->value, 8);
  EXPECT_EQ(info.job_id->value, "slurm-777");
  EXPECT_EQ(info.scheduler_names, std::vector<std::string>{"Slurm"});
  auto tasks = read_scheduler_env({{"SLURM_JOB_NODELIST", "n1"}, {"SLURM_NODEID", "0"}, {"SLURM_NTASKS_PER_NODE", "4"}});
  EXPECT_EQ(tasks.nproc_per_node->value, 4);
  EXPECT_EQ(tasks.nnodes->value, 1);
}

TEST(SchedulerEnv, TorchrunKubeflowOpenMpiTione) {
  auto k = read_scheduler_env({{"MASTER_ADDR", "m"}, {"MASTER_PORT", "23456"}, {"WORLD_SIZE", "3"}, {"RANK", "1"},
                               {"PET_NPROC_PER_NODE", "2"}, {"PET_NNODES", "1:3"}});
  EXPECT_EQ(k.master_addr->value, "m");
  EXPECT_EQ(k.master_port->value, 23456);
  EXPECT_EQ(k.nnodes->value, 3);
  EXPECT_EQ(k.node_rank->value, 1);
  EXPECT_EQ(k.nproc_per_node->value, 2);
  ASSERT_TRUE(k.min_nodes.has_value());  // PET_NNODES=1:3 is Kubeflow's elastic job
  EXPECT_EQ(k.min_nodes->value, 1);
  EXPECT_FALSE(read_scheduler_env({{"PET_NNODES", "3:3"}}).min_nodes.has_value());
  EXPECT_FALSE(read_scheduler_env({{"PET_NNODES", "3"}}).min_nodes.has_value());
  auto rdzv = read_scheduler_env({{"PET_NNODES", "2:4"}, {"PET_RDZV_ENDPOINT", "job-worker-0:29400"}});
  EXPECT_EQ(rdzv.master_addr->value, "job-worker-0");
  EXPECT_EQ(rdzv.master_port->value, 29400);
  EXPECT_EQ(rdzv.master_port->source, "PET_RDZV_ENDPOINT");
  EXPECT_NE(error_of([] { read_scheduler_env({{"PET_NNODES", "4:2"}}); }).find("PET_NNODES=4:2: expected MIN:MAX"),
            std::string::npos);
  auto o = read_scheduler_env({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}});
  EXPECT_EQ(o.nnodes->source, "OMPI_COMM_WORLD_SIZE");
  EXPECT_EQ(o.node_rank->value, 1);
  auto t = read_scheduler_env({{"NODE_LIST", "10.0.0.1:8,10.0.0.2:8"}, {"INDEX", "1"}, {"GPU_NUM_PER_NODE", "8"}});
  EXPECT_EQ(t.nnodes->value, 2);
  EXPECT_EQ(t.master_addr->value, "10.0.0.1");
  EXPECT_EQ(t.node_rank->value, 1);
  EXPECT_EQ(t.nproc_per_node->value, 8);
  auto tf = read_scheduler_env({{"TF_CONFIG", R"({"cluster":{"worker":["w0:2222","w1:2222"]},"task":{"type":"worker","index":1}})"}});
  EXPECT_EQ(tf.master_addr->value, "w0");
  EXPECT_EQ(tf.master_port->value, 2222);
  EXPECT_EQ(tf.node_rank->value, 1);
  EXPECT_TRUE(read_scheduler_env({}).scheduler_names.empty());
}

TEST(SchedulerEnv, ConflictsNameBothSources) {
  EXPECT_EQ(error_of([] { read_scheduler_env({{"WORLD_SIZE", "2"}, {"PET_NNODES", "4"}}); }),
            "conflicting node count: WORLD_SIZE says 2 but PET_NNODES says 4");
  EXPECT_EQ(error_of([] {
              read_scheduler_env({{"SLURM_JOB_NODELIST", "a[1-2]"}, {"SLURM_NODEID", "0"}, {"MASTER_ADDR", "b"}});
            }),
            "conflicting master address: SLURM_JOB_NODELIST (first node) says a1 but MASTER_ADDR says b");
  EXPECT_EQ(error_of([] { read_scheduler_env({{"WORLD_SIZE", "2"}, {"RANK", "2"}}); }),
            "node rank 2 (RANK) is not below the node count 2 (WORLD_SIZE)");
  EXPECT_EQ(error_of([] { read_scheduler_env({{"WORLD_SIZE", "two"}}); }), "WORLD_SIZE=two: expected an integer >= 1");
}

// TI-ONE's Ray mode (the seed's variables): HEAD_ADDR and HEAD_PORT name the Ray head and its GCS port,
// RANK is the node's rank (0: the head), read as torchrun's. They are kept apart from the master address:
// only a --ray job uses them (plan_test.cc).
TEST(SchedulerEnv, TioneRayHeadAddrHeadPortRank) {
  auto t = read_scheduler_env(
      {{"HEAD_ADDR", "train-1282671078021627392-9qu5j2n90b9c-head-0"}, {"HEAD_PORT", "6379"}, {"RANK", "2"}});
  ASSERT_TRUE(t.ray_head_addr.has_value());
  EXPECT_EQ(t.ray_head_addr->value, "train-1282671078021627392-9qu5j2n90b9c-head-0");
  EXPECT_EQ(t.ray_head_addr->source, "HEAD_ADDR");
  ASSERT_TRUE(t.ray_head_port.has_value());
  EXPECT_EQ(t.ray_head_port->value, 6379);
  EXPECT_EQ(t.node_rank->value, 2);
  EXPECT_FALSE(t.master_addr.has_value());
  EXPECT_FALSE(t.nnodes.has_value());  // the seed's three variables do not say how many nodes
  EXPECT_NE(std::find(t.scheduler_names.begin(), t.scheduler_names.end(), "TI-ONE (Ray)"), t.scheduler_names.end());
  EXPECT_EQ(error_of([] { read_scheduler_env({{"HEAD_PORT", "70000"}}); }), "HEAD_PORT=70000: the port is above 65535");
  EXPECT_EQ(error_of([] { read_scheduler_env({{"HEAD_PORT", "redis"}}); }), "HEAD_PORT=redis: expected an integer >= 1");
  EXPECT_EQ(error_of([] { read_scheduler_env({{"HEAD_ADDR", "head 0"}}); }),
            "HEAD_ADDR=head 0: not a host name or address (' ' cannot appear in one)");
  EXPECT_FALSE(read_scheduler_env({{"RANK", "0"}}).ray_head_addr.has_value());
}

// Found by fuzz/launch_parsers_fuzz.cc: lists that expand to billions of entries were built in memory.
TEST(Slurm, ExpansionBombsAreRefused) {
  EXPECT_EQ(error_of([] { expand_slurm_nodelist("n[0-99999]r[0-99999]"); }),
            "Slurm node list 'n[0-99999]r[0-99999]': expands to more than 100000 nodes");
  EXPECT_EQ(expand_slurm_nodelist("n[0-99999]").size(), 100000u);
  EXPECT_EQ(error_of([] { expand_slurm_counts("1(x1000000000)", "SLURM_TASKS_PER_NODE"); }),
            "SLURM_TASKS_PER_NODE=1(x1000000000): more than 100000 entries");
}

// Found by fuzz/launch_parsers_fuzz.cc: a port above 65535 from the environment was accepted.
TEST(SchedulerEnv, PortOutOfRangeIsOneLine) {
  EXPECT_EQ(error_of([] { read_scheduler_env({{"MASTER_ADDR", "m"}, {"MASTER_PORT", "2959500"}}); }),
            "MASTER_PORT: port 2959500 is not between 1 and 65535");
  EXPECT_EQ(error_of([] {
              read_scheduler_env({{"TF_CONFIG", R"({"cluster":{"worker":["h0:70000"]},"task":{"type":"worker","index":0}})"}});
            }),
            "TF_CONFIG (first cluster entry): port 70000 is not between 1 and 65535");
}


// The ranks a failed worker's stderr reports gone (Job::early_exit_cause), in every form the
// communicator and the transports write, read without std::regex.
TEST(ExitReports, RankReportedGone) {
  EXPECT_EQ(rank_reported_gone("rank 0: peer rank 1 exited (code 0) while rank 0 waited in allreduce #3"), 1);
  EXPECT_EQ(rank_reported_gone("rank 1 (job rank 5) exited (code 0) during barrier"), 5);
  EXPECT_EQ(rank_reported_gone("shm: rank 2 (node-a) (pid 991) exited during allreduce"), 2);
  EXPECT_EQ(rank_reported_gone("tcp: lost rank 3 (10.0.0.2): connection reset"), 3);
  EXPECT_EQ(rank_reported_gone("lost rank 3"), 3);
  EXPECT_EQ(rank_reported_gone("rank 4 (node-b) left the communicator"), 4);
  // The communicator's words come first, wherever they stand in the line.
  EXPECT_EQ(rank_reported_gone("lost rank 3 (h) after rank 6 exited (code 0)"), 6);
  // Not these: another exit code, a word that only ends in "rank", a number that runs into a word.
  EXPECT_EQ(rank_reported_gone("rank 1 exited (code 3)"), std::nullopt);
  EXPECT_EQ(rank_reported_gone("frank 1 exited (code 0)"), std::nullopt);
  EXPECT_EQ(rank_reported_gone("lost rank 3x"), std::nullopt);
  EXPECT_EQ(rank_reported_gone("rank 4 (node-b left"), std::nullopt);
  EXPECT_EQ(rank_reported_gone("shm: rank 2 (node-a) (pid x) exited during allreduce"), std::nullopt);
  EXPECT_EQ(rank_reported_gone("lost rank 99999999999999999999"), std::nullopt);  // no int: not a rank
  EXPECT_EQ(rank_reported_gone(""), std::nullopt);
}

}  // namespace
}  // namespace cohort::launch
