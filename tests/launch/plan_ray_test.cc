// Unit tests of Ray mode's plan (--ray, src/launch/plan_ray.cc): TI-ONE's seed environment, a Ray job
// over hosts, what it refuses, and its dry-run text.
#include <algorithm>

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "launch/plan.h"
#include "launch_test_util.h"
#include "plan_test_util.h"

namespace cohort::launch {
namespace {

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
