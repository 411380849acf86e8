// cohort::torch::FullyShardedDataParallel with the model on a GPU, ranks as threads. Needs a torch with
// CUDA that sees a GPU: scripts/gpu_check.sh runs these on a GPU machine; elsewhere (this project's CI)
// each test is skipped with the reason. Two ranks, one GPU each (NCCL), where there are two GPUs; one
// rank on a one-GPU machine: ranks as threads cannot share a GPU here, as autograd runs every backward
// on a GPU in that GPU's one thread, so one rank's collective in a backward hook would wait for the
// other's backward, queued behind it. (bert --fsdp in scripts/gpu_check.sh shares one GPU between two
// processes.)
// tests/gpu/fsdp_schedule_fake_test.cc checks the stream order of the same schedule without a GPU.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <optional>

#include "cohort/error.h"
#include "cohort/gpu.h"
#include "cohort/torch/fsdp.h"
#include "support/test_support.h"
#include "train/thread_communicator.h"

namespace cohort::torch {
namespace {

using cohort::test::run_ranks;
using cohort::test::ThreadCommunicator;
namespace nn = ::torch::nn;

#define SKIP_WITHOUT_GPU()                                                                      \
  if (!::torch::cuda::is_available())                                                           \
  GTEST_SKIP() << "torch sees no CUDA GPU (torch::cuda::is_available() is false): FSDP on a GPU " \
                  "runs in scripts/gpu_check.sh"

constexpr int kSteps = 3, kBatch = 8;
int world() { return std::min<int>(2, static_cast<int>(::torch::cuda::device_count())); }

// Units by size: the two larger Linear layers; LayerNorm and the last Linear form the root unit.
nn::Sequential make_mlp() {
  return nn::Sequential(nn::Linear(20, 15), nn::LayerNorm(nn::LayerNormOptions({15})), nn::ReLU(), nn::Linear(15, 7),
                        nn::ReLU(), nn::Linear(7, 4));
}
FSDPOptions by_size() {
  FSDPOptions o;
  o.auto_wrap_min_params = 100;
  return o;
}

// The weights rank 0 starts from (FSDP broadcasts them), made once outside the rank threads: torch's
// generator is global.
const std::vector<::torch::Tensor>& initial_weights() {
  static const std::vector<::torch::Tensor> weights = [] {
    ::torch::manual_seed(0);
    std::vector<::torch::Tensor> out;
    for (auto& p : make_mlp()->parameters()) out.push_back(p.detach().clone());
    return out;
  }();
  return weights;
}
// Rank r's model on `device`; rank 0's with the initial weights.
nn::Sequential model_on(const ::torch::Device& device, int rank) {
  auto model = make_mlp();
  if (rank == 0) {
    ::torch::NoGradGuard no_grad;
    auto ps = model->parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(initial_weights()[i]);
  }
  model->to(device);
  return model;
}
::torch::Device gpu_of(int rank) { return {::torch::kCUDA, static_cast<c10::DeviceIndex>(rank)}; }

struct Batch {
  ::torch::Tensor x, y;
};
Batch batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step * 2 + rank);
  return {::torch::randn({kBatch, 20}, gen), ::torch::randint(0, 4, {kBatch}, gen, ::torch::kLong)};
}

// kSteps of SGD with momentum, clipped to a global norm the gradients exceed; the norms in `norms`.
void train(FullyShardedDataParallel& fsdp, int rank, const ::torch::Device& device, int from, int to,
           std::vector<double>* norms = nullptr, ::torch::Dtype input = ::torch::kFloat32) {
  ::torch::optim::SGD opt(fsdp.parameters(), ::torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = from; step < to; ++step) {
    auto b = batch(step, rank);
    opt.zero_grad();
    auto out = fsdp.forward(b.x.to(device).to(input));
    ::torch::nn::functional::cross_entropy(out.to(::torch::kFloat32), b.y.to(device)).backward();
    const double norm = fsdp.clip_grad_norm(0.05);
    if (norms) norms->push_back(norm);
    opt.step();
  }
}

// Rank 0's gathered weights after training on `device` (the CPU, or each rank's GPU).
std::vector<std::pair<std::string, ::torch::Tensor>> trained(bool on_gpu, FSDPOptions options,
                                                             std::vector<double>* norms,
                                                             ::torch::Dtype input = ::torch::kFloat32) {
  std::vector<std::pair<std::string, ::torch::Tensor>> out;
  auto comms = ThreadCommunicator::make_world(world());
  run_ranks(world(), [&](int rank) {
    const ::torch::Device device = on_gpu ? gpu_of(rank) : ::torch::Device(::torch::kCPU);
    FullyShardedDataParallel fsdp(model_on(device, rank), comms[size_t(rank)], options);
    std::vector<double> mine;
    train(fsdp, rank, device, 0, kSteps, &mine, input);
    auto full = fsdp.full_state_dict();
    if (on_gpu) {
      EXPECT_TRUE(fsdp.device().is_cuda());
      EXPECT_EQ(gpu::device_of(fsdp.communicator()), device.index()) << "FSDP wraps the host communicator on its GPU";
      for (const auto& shard : fsdp.parameters()) {
        EXPECT_EQ(shard.device(), device) << "a shard";
        EXPECT_EQ(shard.scalar_type(), ::torch::kFloat32) << "the master weights";
        ASSERT_TRUE(shard.grad().defined());
        EXPECT_EQ(shard.grad().device(), device) << "a shard's gradient";
      }
    }
    for (const auto& [name, t] : full) EXPECT_TRUE(t.device().is_cpu()) << name << ": full_state_dict() is on the CPU";
    if (rank == 0) out = std::move(full), *norms = mine;
  });
  return out;
}

void expect_close(const std::vector<std::pair<std::string, ::torch::Tensor>>& got,
                  const std::vector<std::pair<std::string, ::torch::Tensor>>& want, double rtol, double atol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(::torch::allclose(got[i].second, want[i].second, rtol, atol))
        << want[i].first << ": max difference " << (got[i].second - want[i].second).abs().max().item<float>();
}

class FsdpCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ::torch::set_num_threads(1);
    initial_weights();
  }
};

TEST_F(FsdpCuda, TrainsOnTheGpuAsOnTheCpuWithClippingByTheGlobalNorm) {
  SKIP_WITHOUT_GPU();
  std::vector<double> cpu_norms, gpu_norms;
  const auto cpu = trained(false, by_size(), &cpu_norms);
  const auto gpu = trained(true, by_size(), &gpu_norms);
  ASSERT_EQ(gpu_norms.size(), cpu_norms.size());
  for (size_t i = 0; i < cpu_norms.size(); ++i) {
    EXPECT_NEAR(gpu_norms[i], cpu_norms[i], 1e-4 * cpu_norms[i]) << "step " << i;
    EXPECT_GT(cpu_norms[i], 0.05) << "the test must clip";
  }
  expect_close(gpu, cpu, 1e-3, 1e-4);  // GPU kernels sum in another order than the CPU's
}

// bfloat16 compute (the units gathered in it), and separately 16-bit gradients on the wire (a mean
// reduce-scattered in bfloat16): both close to float32 training; the master weights stay float32.
TEST_F(FsdpCuda, MixedPrecisionAndCompressedGradientsOnTheGpuKeepFloat32MasterWeights) {
  SKIP_WITHOUT_GPU();
  FSDPOptions bf16 = by_size(), compressed = by_size();
  bf16.compute_dtype = ::torch::kBFloat16;
  compressed.compression = train::WireCompression::kBFloat16;
  std::vector<double> norms32, norms16, norms_wire;
  const auto full32 = trained(true, by_size(), &norms32);
  const auto full16 = trained(true, bf16, &norms16, ::torch::kBFloat16);
  const auto wire16 = trained(true, compressed, &norms_wire);
  for (const auto& [name, t] : full16) EXPECT_EQ(t.scalar_type(), ::torch::kFloat32) << name;
  for (double n : norms16) EXPECT_TRUE(std::isfinite(n));
  expect_close(full16, full32, 0.05, 0.02);  // bfloat16 keeps 8 bits of mantissa
  expect_close(wire16, full32, 0.05, 0.02);
}

// Sharded on the GPUs, loaded by one rank on the CPU: a checkpoint holds CPU tensors, and the
// consolidated model loads into a plain libtorch module.
TEST_F(FsdpCuda, CheckpointsWrittenOnTheGpuLoadOnTheCpu) {
  SKIP_WITHOUT_GPU();
  cohort::test::TempDir tmp;
  const std::string full_path = tmp.path() + "/full.pt";
  std::vector<std::pair<std::string, ::torch::Tensor>> saved;
  auto comms = ThreadCommunicator::make_world(world());
  run_ranks(world(), [&](int rank) {
    const ::torch::Device device = gpu_of(rank);
    FullyShardedDataParallel fsdp(model_on(device, rank), comms[size_t(rank)], by_size());
    ::torch::optim::Adam opt(fsdp.parameters(), ::torch::optim::AdamOptions(1e-2));
    auto b = batch(0, rank);
    ::torch::nn::functional::cross_entropy(fsdp.forward(b.x.to(device)), b.y.to(device)).backward();
    opt.step();
    fsdp.save(tmp.path(), opt, train::TrainingPosition{0, 1, 1});
    fsdp.save_full_model(full_path);
    auto full = fsdp.full_state_dict();
    if (rank == 0) saved = std::move(full);
  });
  auto one = ThreadCommunicator::make_world(1);
  FullyShardedDataParallel fsdp(model_on(::torch::kCPU, 0), one[0], by_size());
  ::torch::optim::Adam opt(fsdp.parameters(), ::torch::optim::AdamOptions(1e-2));
  const auto position = fsdp.load(tmp.path(), opt);
  ASSERT_TRUE(position.has_value());
  EXPECT_EQ(position->global_step, 1);
  const auto loaded = fsdp.full_state_dict();
  ASSERT_EQ(loaded.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(::torch::equal(loaded[i].second, saved[i].second)) << saved[i].first;
  auto plain = make_mlp();
  ::torch::load(plain, full_path);
  auto ps = plain->parameters();
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(::torch::equal(ps[i], saved[i].second)) << saved[i].first;
}

TEST_F(FsdpCuda, AModelOnTwoDevicesOrACommunicatorOnAnotherGpuIsOneLine) {
  SKIP_WITHOUT_GPU();
  auto comms = ThreadCommunicator::make_world(1);
  auto split = make_mlp();
  split->ptr(0)->to(::torch::Device(::torch::kCUDA, 0));
  try {
    FullyShardedDataParallel fsdp(split, comms[0], by_size());
    ADD_FAILURE() << "a model on the CPU and a GPU was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("is on cpu but 0.weight is on cuda:0: one device per model replica"),
              std::string::npos)
        << e.what();
  }
  if (::torch::cuda::device_count() < 2) {
    std::cout << "[   NOTE   ] one GPU: a communicator on another GPU than the model's is not tried\n";
    return;
  }
  auto on_gpu0 = gpu::make_device_communicator(comms[0], {0, gpu::DevicePath::kAuto});
  try {
    FullyShardedDataParallel fsdp(model_on(::torch::Device(::torch::kCUDA, 1), 0), on_gpu0, by_size());
    ADD_FAILURE() << "a model on cuda:1 was given a communicator on GPU 0";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP: the model is on cuda:1 but the communicator uses GPU 0"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace cohort::torch
