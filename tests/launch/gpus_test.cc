// GPU planning in the launcher, from fake `nvidia-smi -L` output and a fake sysfs tree: parsing,
// CUDA_VISIBLE_DEVICES, one GPU per rank (or shared), CPU binding next to each GPU, the worker
// environment, and the one-line errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "cohort/error.h"
#include "launch/gpus.h"
#include "launch/plan.h"
#include "launch_test_util.h"

namespace cohort::launch {
namespace {

// What `nvidia-smi -L` prints on a 4-GPU machine with MIG on GPU 3.
const char* kFourGpus =
    "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a0a0a0a-1111-2222-3333-444444444444)\n"
    "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1b1b1b1b-1111-2222-3333-444444444444)\n"
    "GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-2c2c2c2c-1111-2222-3333-444444444444)\n"
    "GPU 3: NVIDIA A100-SXM4-40GB (UUID: GPU-3d3d3d3d-1111-2222-3333-444444444444)\n"
    "  MIG 1g.5gb      Device  0: (UUID: MIG-5e5e5e5e-1111-2222-3333-444444444444)\n";

TEST(Gpus, ParsesNvidiaSmiList) {
  auto gpus = parse_nvidia_smi_list(kFourGpus);
  ASSERT_EQ(gpus.size(), 4u);  // the MIG line is not a GPU of its own
  EXPECT_EQ(gpus[0].index, 0);
  EXPECT_EQ(gpus[0].name, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(gpus[0].uuid, "GPU-0a0a0a0a-1111-2222-3333-444444444444");
  EXPECT_EQ(gpus[3].name, "NVIDIA A100-SXM4-40GB");
  EXPECT_TRUE(parse_nvidia_smi_list("").empty());
  EXPECT_TRUE(parse_nvidia_smi_list("No devices found.\n").empty());
  EXPECT_EQ(error_of([] { parse_nvidia_smi_list("GPU x: broken\n"); }),
            "nvidia-smi -L, line 1: expected 'GPU <index>: <name> (UUID: GPU-...)', got 'GPU x: broken'");
}

TEST(Gpus, NormalisesBusIds) {
  EXPECT_EQ(normalise_pci_bus_id("00000000:18:00.0"), "0000:18:00.0");
  EXPECT_EQ(normalise_pci_bus_id("0000:AF:00.0"), "0000:af:00.0");
  EXPECT_EQ(normalise_pci_bus_id("3b:00.0"), "0000:3b:00.0");
}

class FakeSysfs : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = std::filesystem::temp_directory_path() / ("cohort-gpus-test-" + std::to_string(getpid()));
    std::filesystem::remove_all(root_);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  void device(const std::string& bus, int numa, const std::string& cpulist) {
    auto dir = root_ / "bus/pci/devices" / bus;
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "numa_node") << numa << "\n";
    std::ofstream(dir / "local_cpulist") << cpulist << "\n";
  }
  std::filesystem::path root_;
};

TEST_F(FakeSysfs, LocalityFromProcBusIdsAndSysfs) {
  device("0000:18:00.0", 0, "0-15");
  device("0000:3b:00.0", 0, "0-15");
  device("0000:86:00.0", 1, "16-31");
  device("0000:af:00.0", 1, "16-31");
  auto gpus = parse_nvidia_smi_list(kFourGpus);
  add_gpu_locality(gpus, {"0000:18:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:af:00.0"}, root_.string());
  EXPECT_EQ(gpus[2].pci_bus_id, "0000:86:00.0");
  EXPECT_EQ(gpus[2].numa_node, 1);
  EXPECT_EQ(gpus[2].local_cpus.front(), 16);
  EXPECT_EQ(gpus[2].local_cpus.size(), 16u);
  EXPECT_EQ(gpus[2].describe(), "GPU 2 (NVIDIA H100 80GB HBM3, 0000:86:00.0, NUMA 1)");

  // Counts that disagree (a GPU the driver hides): no guessing by position.
  auto partial = parse_nvidia_smi_list(kFourGpus);
  add_gpu_locality(partial, {"0000:18:00.0"}, root_.string());
  EXPECT_EQ(partial[0].pci_bus_id, "");
  EXPECT_EQ(partial[0].numa_node, -1);
}

TEST(Gpus, CudaVisibleDevicesNarrowsAndOrders) {
  auto detected = parse_nvidia_smi_list(kFourGpus);
  auto all = visible_gpus(detected, "nvidia-smi -L", {});
  EXPECT_EQ(all.gpus.size(), 4u);
  EXPECT_EQ(all.visible_ids, (std::vector<std::string>{"0", "1", "2", "3"}));

  auto two = visible_gpus(detected, "nvidia-smi -L", {{"CUDA_VISIBLE_DEVICES", "2,GPU-0a0a"}});
  ASSERT_EQ(two.gpus.size(), 2u);
  EXPECT_EQ(two.gpus[0].index, 2);  // worker device 0 is the driver's GPU 2
  EXPECT_EQ(two.gpus[1].index, 0);
  EXPECT_EQ(two.visible_ids, (std::vector<std::string>{"2", "GPU-0a0a"}));

  EXPECT_TRUE(visible_gpus(detected, "nvidia-smi -L", {{"CUDA_VISIBLE_DEVICES", ""}}).gpus.empty());
  EXPECT_TRUE(visible_gpus(detected, "nvidia-smi -L", {{"CUDA_VISIBLE_DEVICES", "-1"}}).gpus.empty());
  EXPECT_EQ(error_of([&] { visible_gpus(detected, "nvidia-smi -L", {{"CUDA_VISIBLE_DEVICES", "0,7"}}); }),
            "CUDA_VISIBLE_DEVICES=0,7: '7' is not one of this machine's GPUs (4 found by nvidia-smi -L)");
  // Nothing detected (a container without nvidia-smi): the variable's entries are the GPUs.
  auto blind = visible_gpus({}, "none found (nvidia-smi -L missing)", {{"CUDA_VISIBLE_DEVICES", "4,5"}});
  EXPECT_EQ(blind.gpus.size(), 2u);
  EXPECT_EQ(blind.visible_ids, (std::vector<std::string>{"4", "5"}));
}

TEST(Gpus, AssignsOneGpuPerRankOrShares) {
  auto inv = visible_gpus(parse_nvidia_smi_list(kFourGpus), "nvidia-smi -L", {});
  auto a = assign_gpus("auto", false, 4, inv, "here");
  for (int l = 0; l < 4; ++l) EXPECT_EQ(a[l].device, l);
  auto two = assign_gpus("2", false, 2, inv, "here");
  EXPECT_EQ(two[1].device, 1);
  auto shared = assign_gpus("2", true, 4, inv, "here");
  EXPECT_EQ(shared[2].device, 0);
  EXPECT_EQ(shared[3].device, 1);
  EXPECT_EQ(assign_gpus("", false, 3, inv, "here")[0].device, -1);  // not a GPU job

  EXPECT_EQ(error_of([&] { assign_gpus("auto", false, 5, inv, "here"); }),
            "5 local ranks on here but --gpus-per-node auto gives 4 GPUs: one GPU per rank (lower --nproc-per-node, "
            "or pass --gpu-share to let ranks share GPUs)");
  EXPECT_EQ(error_of([&] { assign_gpus("8", false, 1, inv, "here"); }),
            "--gpus-per-node 8: here has 4 GPUs (nvidia-smi -L)");
  EXPECT_EQ(error_of([&] { assign_gpus("0", false, 1, inv, "here"); }),
            "--gpus-per-node 0: expected a positive number or 'auto'");
  GpuInventory none{{}, "none found (nvidia-smi -L missing; /proc/driver/nvidia/gpus missing)", {}};
  EXPECT_EQ(error_of([&] { assign_gpus("auto", false, 1, none, "here"); }),
            "--gpus-per-node auto: no GPU on here (none found (nvidia-smi -L missing; /proc/driver/nvidia/gpus "
            "missing))");
}

TEST(Gpus, BindsRanksNextToTheirGpus) {
  std::vector<int> allowed;
  for (int c = 0; c < 32; ++c) allowed.push_back(c);
  std::vector<int> numa0, numa1;
  for (int c = 0; c < 16; ++c) numa0.push_back(c), numa1.push_back(c + 16);
  // Ranks 0,1 on GPUs of NUMA 1, rank 2 on NUMA 0: each gets a disjoint block next to its GPU.
  auto b = compute_bindings("auto", 3, allowed, {numa0, numa1}, {}, {numa1, numa1, numa0});
  EXPECT_EQ(b[0], (std::vector<int>{16, 17, 18, 19, 20, 21, 22, 23}));
  EXPECT_EQ(b[1], (std::vector<int>{24, 25, 26, 27, 28, 29, 30, 31}));
  EXPECT_EQ(b[2], numa0);
  // Unknown locality for one rank: the ordinary blocks.
  auto plain = compute_bindings("auto", 2, allowed, {numa0, numa1}, {}, {});
  EXPECT_EQ(plain[0], numa0);
  // --bind-to none stays none.
  EXPECT_TRUE(compute_bindings("none", 2, allowed, {}, {}, {numa1, numa1})[0].empty());
}

std::string fake_resolve(const std::string& p) { return "/bin/" + p; }

MachineFacts gpu_machine() {
  MachineFacts m;
  m.hostname = "here";
  m.cpu_count = 32;
  m.resolve_program = &fake_resolve;
  m.gpus = visible_gpus(parse_nvidia_smi_list(kFourGpus), "nvidia-smi -L", {});
  m.gpu_count = 4;
  return m;
}

TEST(Gpus, PlanTakesOneRankPerGpuAndSetsTheEnvironment) {
  Options o;
  o.program = {"train"};
  o.gpus_per_node = "auto";
  auto p = build_plan(o, {}, gpu_machine());
  EXPECT_EQ(p.world_size, 4);  // no --nproc-per-node: one rank per GPU
  EXPECT_EQ(p.gpus_per_node, 4);
  EXPECT_EQ(p.source_of("nproc per node"), "--gpus-per-node (one rank per GPU)");
  EXPECT_EQ(p.source_of("gpus per node"), "--gpus-per-node auto (nvidia-smi -L)");

  auto gpus = assign_gpus(p.gpus_per_node_spec, p.gpu_share, 4, gpu_machine().gpus, "here");
  WorkerSlot slot{2, 2, 4, 0, gpus[2]};
  auto env = worker_env(p, slot, "127.0.0.1:1", 2, "t", 0, {});
  // torchrun's contract: CUDA_VISIBLE_DEVICES untouched, LOCAL_RANK names the device.
  EXPECT_EQ(env_value(env, "LOCAL_RANK"), "2");
  EXPECT_EQ(env_value(env, "CUDA_VISIBLE_DEVICES"), "(unset)");
  EXPECT_EQ(env_value(env, "COHORT_LOCAL_GPU"), "2");
  EXPECT_EQ(env_value(env, "COHORT_GPUS_PER_NODE"), "4");

  o.device_per_rank = true;  // narrowed: each rank sees only its GPU, as device 0
  auto narrowed = build_plan(o, {}, gpu_machine());
  auto env2 = worker_env(narrowed, slot, "127.0.0.1:1", 2, "t", 0, {});
  EXPECT_EQ(env_value(env2, "CUDA_VISIBLE_DEVICES"), "2");
  EXPECT_EQ(env_value(env2, "COHORT_LOCAL_GPU"), "0");

  auto text = describe_plan(p, {}, "127.0.0.1:1", gpu_machine().gpus);
  EXPECT_NE(text.find("gpus per node   4, one per rank  [--gpus-per-node auto (nvidia-smi -L)]"), std::string::npos)
      << text;
  EXPECT_NE(text.find("rank 3 (local 3) GPU 3 (NVIDIA A100-SXM4-40GB),"), std::string::npos) << text;
}

TEST(Gpus, PlanRefusesMoreRanksThanGpusUnlessShared) {
  Options o;
  o.program = {"train"};
  o.gpus_per_node = "2";
  o.nproc_per_node = "3";
  EXPECT_EQ(error_of([&] { build_plan(o, {}, gpu_machine()); }),
            "3 local ranks on here but --gpus-per-node 2 gives 2 GPUs: one GPU per rank (lower --nproc-per-node, or "
            "pass --gpu-share to let ranks share GPUs)");
  o.gpu_share = true;
  EXPECT_EQ(build_plan(o, {}, gpu_machine()).world_size, 3);
  Options share_only;
  share_only.program = {"train"};
  share_only.gpu_share = true;
  EXPECT_EQ(error_of([&] { build_plan(share_only, {}, gpu_machine()); }), "--gpu-share needs --gpus-per-node");
  // A fan-out head without GPUs of its own leaves the count to each host, but checks the syntax.
  Options fan;
  fan.program = {"train"};
  fan.hosts = "a:2,b:2";
  fan.gpus_per_node = "two";
  MachineFacts head = gpu_machine();
  head.gpus = {};
  EXPECT_EQ(error_of([&] { build_plan(fan, {}, head); }), "--gpus-per-node two: expected a positive number or 'auto'");
  fan.gpus_per_node = "2";
  EXPECT_EQ(build_plan(fan, {}, head).gpus_per_node, 0);
}

}  // namespace
}  // namespace cohort::launch
