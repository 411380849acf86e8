// cohort::torch::FullyShardedDataParallel (ZeRO stage 3), ranks as threads over the ThreadCommunicator
// test double.
//
// Each test trains the same model from the same weights on the same per-rank batches twice: under the
// existing DistributedDataParallel, and under FSDP with a plain libtorch optimizer over the shards. The
// averaged gradient is the same sum (the reduce-scatter adds in another order than the allreduce), and
// the optimizers are elementwise, so the whole weights agree to float rounding:
// torch::allclose(rtol = 1e-4, atol = 1e-5), as the sharded optimizer's tests.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>


#include "cohort/error.h"
#include "cohort/torch/ddp.h"
#include "cohort/torch/fsdp.h"
#include "support/test_support.h"
#include "train/thread_communicator.h"

namespace cohort::torch {
namespace {

using cohort::test::run_ranks;
using cohort::test::ThreadCommunicator;
namespace nn = ::torch::nn;

constexpr double kRtol = 1e-4, kAtol = 1e-5;
constexpr int kGlobalBatch = 12;  // divides by 1, 2, 3 and 4 ranks
constexpr int kSteps = 3;

enum class Net { kMlp, kConv, kNorm };
const char* name_of(Net n) { return n == Net::kMlp ? "mlp" : n == Net::kConv ? "conv" : "batchnorm"; }

// Parameter counts chosen so that units do not divide by 2, 3 or 4: 315, 30 (LayerNorm), 112, 32.
nn::Sequential make_mlp() {
  return nn::Sequential(nn::Linear(20, 15), nn::LayerNorm(nn::LayerNormOptions({15})), nn::ReLU(), nn::Linear(15, 7),
                        nn::ReLU(), nn::Linear(7, 4));
}
// 30, 140 and 324 parameters.
nn::Sequential make_conv() {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 3, 3)), nn::ReLU(), nn::Conv2d(nn::Conv2dOptions(3, 5, 3)),
                        nn::ReLU(), nn::Flatten(), nn::Linear(80, 4));
}
// An MLP with batch norm, whose running statistics are buffers that differ between ranks' batches.
nn::Sequential make_norm() {
  return nn::Sequential(nn::Linear(20, 15), nn::BatchNorm1d(15), nn::ReLU(), nn::Linear(15, 4));
}
nn::Sequential make(Net n) { return n == Net::kMlp ? make_mlp() : n == Net::kConv ? make_conv() : make_norm(); }

// The MLP's units by size (two Linear layers; LayerNorm and the last Linear form the root unit), the
// conv net's by type (both convolutions; the Linear is the root).
FSDPOptions units_for(Net n, bool reshard) {
  FSDPOptions o;
  o.reshard_after_forward = reshard;
  if (n != Net::kConv) o.auto_wrap_min_params = 100;
  else o.auto_wrap_module_types = {"torch::nn::Conv2dImpl"};
  return o;
}

struct Batch {
  ::torch::Tensor x, y;
};
Batch batch(Net n, int it, int rank, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3000 + it);
  ::torch::Tensor x = n != Net::kConv ? ::torch::randn({kGlobalBatch, 20}, gen) : ::torch::randn({kGlobalBatch, 1, 8, 8}, gen);
  ::torch::Tensor y = ::torch::randint(0, 4, {kGlobalBatch}, gen, ::torch::kLong);
  const int share = kGlobalBatch / world;
  return {x.narrow(0, rank * share, share), y.narrow(0, rank * share, share)};
}

// The MLP trains with SGD and momentum, the conv net with AdamW: any libtorch optimizer, on the shards.
// (Adam's step hardly depends on the gradients' scale: the gradient norms are compared too.)
std::unique_ptr<::torch::optim::Optimizer> make_optimizer(Net n, std::vector<::torch::Tensor> params) {
  if (n == Net::kMlp)
    return std::make_unique<::torch::optim::SGD>(params, ::torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
  return std::make_unique<::torch::optim::AdamW>(params, ::torch::optim::AdamWOptions(1e-2).weight_decay(0.05));
}

// Initial weights, made once: each rank's model is built in its own thread (torch's generator is
// global), and rank 0's gets these, which both wrappers broadcast.
std::vector<::torch::Tensor> initial_weights(Net n) {
  ::torch::manual_seed(0);
  std::vector<::torch::Tensor> out;
  for (auto& p : make(n)->parameters()) out.push_back(p.detach().clone());
  return out;
}
nn::Sequential model_with(Net n, const std::vector<::torch::Tensor>& initial, int rank) {
  auto model = make(n);
  if (rank == 0) {
    ::torch::NoGradGuard g;
    auto ps = model->parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(initial[i]);
  }
  return model;
}

// DDP's weights after kSteps (rank 0's; DDP keeps every rank's equal), and in `norms` the averaged
// gradients' global norm at each step. max_norm > 0: clipped to it each step.
constexpr double kNoClip = 1e30;
std::vector<::torch::Tensor> ddp_weights(Net n, int world, double max_norm = kNoClip, std::vector<double>* norms = nullptr,
                                         DDPOptions options = {}) {
  const auto initial = initial_weights(n);
  std::vector<::torch::Tensor> out;
  auto comms = ThreadCommunicator::make_world(world);
  run_ranks(world, [&](int rank) {
    auto model = model_with(n, initial, rank);
    DistributedDataParallel ddp(model, comms[size_t(rank)], options);
    auto opt = make_optimizer(n, ddp.parameters());
    for (int it = 0; it < kSteps; ++it) {
      auto b = batch(n, it, rank, world);
      opt->zero_grad();
      ::torch::nn::functional::cross_entropy(ddp->forward(b.x), b.y).backward();
      const double norm = ::torch::nn::utils::clip_grad_norm_(ddp.parameters(), max_norm);
      if (rank == 0 && norms) norms->push_back(norm);
      opt->step();
    }
    if (rank == 0)
      for (auto& p : model->parameters()) out.push_back(p.detach().clone());
  });
  return out;
}

void expect_weights(const std::vector<std::pair<std::string, ::torch::Tensor>>& got,
                    const std::vector<::torch::Tensor>& want, const std::string& where) {
  ASSERT_GE(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(::torch::allclose(got[i].second, want[i], kRtol, kAtol))
        << where << ", " << got[i].first << ": max difference " << (got[i].second - want[i]).abs().max().item<float>();
}

// The world sizes run one after the other inside one test: each test is a process of its own under
// ctest, and loading libtorch costs about 1.8 s of it; the four worlds together take well under a second.
class FsdpTest : public ::testing::TestWithParam<std::tuple<Net, bool>> {
 protected:
  void SetUp() override { ::torch::set_num_threads(1); }
};

TEST_P(FsdpTest, WeightsAfterTrainingEqualDdpAtOneToFourRanks) {
  const auto [net, reshard] = GetParam();
  for (int world = 1; world <= 4; ++world) {
    SCOPED_TRACE(fmt::format("{} ranks", world));
    std::vector<double> norms;
    const auto want = ddp_weights(net, world, kNoClip, &norms);
    const auto initial = initial_weights(net);
    auto comms = ThreadCommunicator::make_world(world);
    run_ranks(world, [&](int rank) {
      auto model = model_with(net, initial, rank);
      FullyShardedDataParallel fsdp(model, comms[size_t(rank)], units_for(net, reshard));
      const auto units = fsdp.units();
      ASSERT_EQ(units.size(), 3u) << "two wrapped layers and the root";
      EXPECT_EQ(units.back().name, "");
      int64_t shard_total = 0, total = 0;
      for (const auto& u : units) {
        EXPECT_EQ(u.shard_numel, (u.numel + world - 1) / world) << u.name;
        shard_total += u.shard_numel;
        total += u.numel;
      }
      for (auto& p : model->parameters()) total -= p.numel();
      EXPECT_EQ(total, 0) << "every parameter in exactly one unit";
      auto opt = make_optimizer(net, fsdp.parameters());
      int64_t shard_params = 0;
      for (auto& p : fsdp.parameters()) shard_params += p.numel();
      EXPECT_EQ(shard_params, shard_total) << "the optimizer sees this rank's shards only";
      for (int it = 0; it < kSteps; ++it) {
        auto b = batch(net, it, rank, world);
        opt->zero_grad();
        auto loss = ::torch::nn::functional::cross_entropy(fsdp.forward(b.x), b.y);
        // Between forward and backward: the wrapped layers are freed with reshard_after_forward, kept
        // without it; the root stays gathered for its backward either way.
        for (size_t u = 0; u + 1 < units.size(); ++u) EXPECT_EQ(fsdp.gathered(u), !reshard) << units[u].name;
        EXPECT_TRUE(fsdp.gathered(units.size() - 1));
        loss.backward();
        // After backward every unit's memory is freed and every shard has its averaged gradient.
        for (size_t u = 0; u < units.size(); ++u) {
          EXPECT_FALSE(fsdp.gathered(u)) << units[u].name;
          EXPECT_TRUE(fsdp.parameters()[u].grad().defined()) << units[u].name;
        }
        for (auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << "no whole gradient is kept";
        const double norm = fsdp.clip_grad_norm(kNoClip);  // the averaged gradient's norm, over every shard
        EXPECT_NEAR(norm, norms.at(size_t(it)), 1e-5 * norms.at(size_t(it))) << "rank " << rank << ", step " << it;
        opt->step();
      }
      // Three units: the third reduce-scatter of a backward waits for the first, so that no more than two
      // flattened gradients are held (one rank does not reduce-scatter at all).
      EXPECT_EQ(fsdp.peak_reduces_in_flight(), world > 1 ? FullyShardedDataParallel::kMaxReducesInFlight : 0u);
      expect_weights(fsdp.full_state_dict(), want,
                     fmt::format("{} on {} ranks, reshard_after_forward={}, rank {}", name_of(net), world, reshard, rank));
    });
  }
}

INSTANTIATE_TEST_SUITE_P(NetsReshard, FsdpTest,
                         ::testing::Combine(::testing::Values(Net::kMlp, Net::kConv), ::testing::Bool()),
                         [](const auto& info) {
                           return fmt::format("{}_{}", name_of(std::get<0>(info.param)),
                                              std::get<1>(info.param) ? "reshard" : "keep");
                         });

class FsdpUnitsTest : public ::testing::Test {
 protected:
  void SetUp() override { ::torch::set_num_threads(1); }
};

TEST_F(FsdpUnitsTest, AUnitThatDoesNotDivideByTheWorldIsPaddedAndTrainsAsDdp) {
  // One explicit unit of 315 parameters at 4 ranks: shards of 79, the last rank's holding 78 values
  // and one element of padding that never reaches a parameter.
  const int world = 4;
  const auto want = ddp_weights(Net::kMlp, world);
  const auto initial = initial_weights(Net::kMlp);
  auto comms = ThreadCommunicator::make_world(world);
  run_ranks(world, [&](int rank) {
    auto model = model_with(Net::kMlp, initial, rank);
    FullyShardedDataParallel fsdp(model, comms[size_t(rank)], {}, {model->ptr(0)});
    const auto units = fsdp.units();
    ASSERT_EQ(units.size(), 2u);
    EXPECT_EQ(units[0].name, "0");
    EXPECT_EQ(units[0].numel, 315);
    EXPECT_EQ(units[0].shard_numel, 79);
    auto opt = make_optimizer(Net::kMlp, fsdp.parameters());
    for (int it = 0; it < kSteps; ++it) {
      auto b = batch(Net::kMlp, it, rank, world);
      opt->zero_grad();
      ::torch::nn::functional::cross_entropy(fsdp.forward(b.x), b.y).backward();
      opt->step();
    }
    if (rank == world - 1) {
      EXPECT_EQ(fsdp.parameters()[0].grad()[78].item<float>(), 0.0f) << "the padding's gradient";
      EXPECT_EQ(fsdp.parameters()[0][78].item<float>(), 0.0f) << "the padding";
    }
    expect_weights(fsdp.full_state_dict(), want, fmt::format("rank {}", rank));
  });
}

TEST_F(FsdpUnitsTest, ClippingByTheGlobalNormAcrossShardsEqualsDdpClipping) {
  const int world = 3;
  const double max_norm = 0.05;  // below the gradients' norm: every step clips
  std::vector<double> ddp_norms;
  const auto want = ddp_weights(Net::kConv, world, max_norm, &ddp_norms);
  const auto initial = initial_weights(Net::kConv);
  auto comms = ThreadCommunicator::make_world(world);
  run_ranks(world, [&](int rank) {
    auto model = model_with(Net::kConv, initial, rank);
    FullyShardedDataParallel fsdp(model, comms[size_t(rank)], units_for(Net::kConv, true));
    auto opt = make_optimizer(Net::kConv, fsdp.parameters());
    for (int it = 0; it < kSteps; ++it) {
      auto b = batch(Net::kConv, it, rank, world);
      opt->zero_grad();
      ::torch::nn::functional::cross_entropy(fsdp.forward(b.x), b.y).backward();
      const double norm = fsdp.clip_grad_norm(max_norm);
      EXPECT_NEAR(norm, ddp_norms.at(size_t(it)), 1e-5 * ddp_norms.at(size_t(it))) << "rank " << rank << ", step " << it;
      EXPECT_GT(norm, max_norm) << "the test must clip";
      opt->step();
    }
    expect_weights(fsdp.full_state_dict(), want, fmt::format("rank {}", rank));
  });
}

TEST_F(FsdpUnitsTest, UnitForwardRunsACustomForwardUnitByUnitAndTheFullModelLoadsInPlainLibtorch) {
  // A module that is not a Sequential: the caller's forward wraps each unit's call.
  cohort::test::TempDir tmp;
  const std::string path = tmp.path() + "/full.pt";
  const int world = 2;
  const auto want = ddp_weights(Net::kMlp, world);
  const auto initial = initial_weights(Net::kMlp);
  auto comms = ThreadCommunicator::make_world(world);
  run_ranks(world, [&](int rank) {
    auto model = model_with(Net::kMlp, initial, rank);
    std::shared_ptr<nn::Module> plain = model.ptr();  // not seen as a Sequential by the wrapper's forward()
    FullyShardedDataParallel fsdp(plain, comms[size_t(rank)], units_for(Net::kMlp, true));
    auto opt = make_optimizer(Net::kMlp, fsdp.parameters());
    for (int it = 0; it < kSteps; ++it) {
      auto b = batch(Net::kMlp, it, rank, world);
      opt->zero_grad();
      auto out = fsdp.forward_with([&] {
        ::torch::Tensor h = b.x;
        for (size_t i = 0; i < model->size(); ++i) {
          auto child = model->ptr(i);
          h = fsdp.unit_forward(*child, [&] { return model->begin()[i].forward(h); });
        }
        return h;
      });
      EXPECT_FALSE(fsdp.gathered(0)) << "freed after its forward";
      ::torch::nn::functional::cross_entropy(out, b.y).backward();
      opt->step();
    }
    const auto full = fsdp.full_state_dict();
    expect_weights(full, want, fmt::format("rank {}", rank));
    fsdp.save_full_model(path);
    if (rank == 0) {
      auto loaded = make_mlp();
      ::torch::load(loaded, path);
      auto ps = loaded->parameters();
      ASSERT_EQ(ps.size(), want.size());
      for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(::torch::equal(ps[i], full[i].second)) << full[i].first;
    }
  });
}

TEST_F(FsdpUnitsTest, PrefetchGathersTheNextUnitWhileThisOneComputes) {
  // Inside the first unit's forward the second unit is already gathered (its all-gather was started
  // before the first one computed), from the second iteration on, when the order of units is known;
  // without prefetch it is gathered only when its own forward starts.
  for (const bool prefetch : {true, false}) {
    const int world = 2;
    const auto initial = initial_weights(Net::kMlp);
    auto comms = ThreadCommunicator::make_world(world);
    run_ranks(world, [&](int rank) {
      auto model = model_with(Net::kMlp, initial, rank);
      FSDPOptions o = units_for(Net::kMlp, true);
      o.prefetch = prefetch;
      FullyShardedDataParallel fsdp(model.ptr(), comms[size_t(rank)], o);
      ASSERT_EQ(fsdp.units()[1].name, "3");
      auto opt = make_optimizer(Net::kMlp, fsdp.parameters());
      for (int it = 0; it < 2; ++it) {
        auto b = batch(Net::kMlp, it, rank, world);
        opt->zero_grad();
        bool second_gathered_early = false;
        auto out = fsdp.forward_with([&] {
          ::torch::Tensor h = b.x;
          for (size_t i = 0; i < model->size(); ++i)
            h = fsdp.unit_forward(*model->ptr(i), [&] {
              if (i == 0) second_gathered_early = fsdp.gathered(1);
              return model->begin()[i].forward(h);
            });
          return h;
        });
        EXPECT_EQ(second_gathered_early, prefetch && it > 0) << "prefetch " << prefetch << ", iteration " << it;
        ::torch::nn::functional::cross_entropy(out, b.y).backward();
        opt->step();
      }
    });
  }
}

TEST_F(FsdpUnitsTest, AUnitThatRanForwardButGotNoGradientIsNamedAtTheNextForward) {
  const int world = 2;
  const auto initial = initial_weights(Net::kMlp);
  auto comms = ThreadCommunicator::make_world(world);
  run_ranks(world, [&](int rank) {
    auto model = model_with(Net::kMlp, initial, rank);
    FullyShardedDataParallel fsdp(model.ptr(), comms[size_t(rank)], units_for(Net::kMlp, true));
    auto b = batch(Net::kMlp, 0, rank, world);
    auto run = [&](bool detach_first) {
      return fsdp.forward_with([&] {
        ::torch::Tensor h = b.x;
        for (size_t i = 0; i < model->size(); ++i) {
          h = fsdp.unit_forward(*model->ptr(i), [&] { return model->begin()[i].forward(h); });
          if (i == 0 && detach_first) h = h.detach();  // unit "0" gets no gradient
        }
        return h;
      });
    };
    ::torch::nn::functional::cross_entropy(run(true), b.y).backward();
    try {
      run(false);
      FAIL() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("unit '0' received no gradient"), std::string::npos) << e.what();
    }
    // The error is reported once; training goes on.
    ::torch::nn::functional::cross_entropy(run(false), b.y).backward();
    for (auto& shard : fsdp.parameters()) EXPECT_TRUE(shard.grad().defined());
  });
}

TEST_F(FsdpUnitsTest, MixedPrecisionComputesInBfloat16AndKeepsFloat32MasterWeights) {
  // bf16 has 8 bits of mantissa: the weights follow DDP's float32 run to DDP's bf16 tolerance
  // (ddp_test.cc) instead of float rounding.
  constexpr double kBf16Rtol = 2e-2, kBf16Atol = 2e-3;
  for (const int world : {2, 3}) {
    SCOPED_TRACE(fmt::format("{} ranks", world));
    const auto want = ddp_weights(Net::kMlp, world);
    const auto initial = initial_weights(Net::kMlp);
    auto comms = ThreadCommunicator::make_world(world);
    run_ranks(world, [&](int rank) {
      auto model = model_with(Net::kMlp, initial, rank);
      FSDPOptions o = units_for(Net::kMlp, true);
      o.compute_dtype = ::torch::kBFloat16;
      FullyShardedDataParallel fsdp(model, comms[size_t(rank)], o);
      auto opt = make_optimizer(Net::kMlp, fsdp.parameters());
      for (int it = 0; it < kSteps; ++it) {
        auto b = batch(Net::kMlp, it, rank, world);
        opt->zero_grad();
        ::torch::Tensor out = fsdp.forward(b.x.to(::torch::kBFloat16));
        EXPECT_EQ(out.scalar_type(), ::torch::kBFloat16) << "computed in bf16";
        EXPECT_EQ(model->parameters().front().scalar_type(), ::torch::kBFloat16);
        ::torch::nn::functional::cross_entropy(out.to(::torch::kFloat32), b.y).backward();
        for (auto& shard : fsdp.parameters()) {
          EXPECT_EQ(shard.scalar_type(), ::torch::kFloat32) << "master weights";
          EXPECT_EQ(shard.grad().scalar_type(), ::torch::kFloat32) << "reduced in float32";
        }
        opt->step();
      }
      // The master weights keep what bf16 cannot hold.
      const ::torch::Tensor master = fsdp.parameters().front().detach();
      EXPECT_FALSE(::torch::equal(master, master.to(::torch::kBFloat16).to(::torch::kFloat32)));
      const auto got = fsdp.full_state_dict();
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(got[i].second.scalar_type(), ::torch::kFloat32);
        EXPECT_TRUE(::torch::allclose(got[i].second, want[i], kBf16Rtol, kBf16Atol))
            << "rank " << rank << ", " << got[i].first << ": max difference "
            << (got[i].second - want[i]).abs().max().item<float>();
      }
    });
  }
}

TEST_F(FsdpUnitsTest, AnExplicitUnitOutsideTheModelIsNamed) {
  auto comms = ThreadCommunicator::make_world(1);
  auto model = make_mlp();
  auto stranger = nn::Linear(3, 3);
  try {
    FullyShardedDataParallel fsdp(model, comms[0], {}, {stranger.ptr()});
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("is not a submodule"), std::string::npos) << e.what();
  }
}

// ---- sharded checkpoints ----

// Trains steps [from, to) of the batches every world size splits alike (the same global batch).
void train_steps(Net n, FullyShardedDataParallel& fsdp, ::torch::optim::Optimizer& opt, int rank, int world, int from,
                 int to) {
  for (int it = from; it < to; ++it) {
    auto b = batch(n, it, rank, world);
    opt.zero_grad();
    ::torch::nn::functional::cross_entropy(fsdp.forward(b.x), b.y).backward();
    opt.step();
  }
}

// Rank 0's whole weights after `steps` uninterrupted steps at `world` ranks.
std::vector<::torch::Tensor> uninterrupted(Net n, int world, int steps) {
  const auto initial = initial_weights(n);
  std::vector<::torch::Tensor> out;
  auto comms = ThreadCommunicator::make_world(world);
  run_ranks(world, [&](int rank) {
    auto model = model_with(n, initial, rank);
    FullyShardedDataParallel fsdp(model, comms[size_t(rank)], units_for(n, true));
    auto opt = make_optimizer(n, fsdp.parameters());
    train_steps(n, fsdp, *opt, rank, world, 0, steps);
    auto full = fsdp.full_state_dict();  // collective
    if (rank == 0)
      for (auto& entry : full) out.push_back(entry.second);
  });
  return out;
}

// Saves after kSaveAt steps at `save_world` ranks into `dir`; returns rank 0's whole weights then.
constexpr int kSaveAt = 2, kTotalSteps = 4;
std::vector<std::pair<std::string, ::torch::Tensor>> train_and_save(Net n, int save_world, const std::string& dir) {
  const auto initial = initial_weights(n);
  std::vector<std::pair<std::string, ::torch::Tensor>> saved;
  auto comms = ThreadCommunicator::make_world(save_world);
  run_ranks(save_world, [&](int rank) {
    auto model = model_with(n, initial, rank);
    FullyShardedDataParallel fsdp(model, comms[size_t(rank)], units_for(n, true));
    auto opt = make_optimizer(n, fsdp.parameters());
    train_steps(n, fsdp, *opt, rank, save_world, 0, kSaveAt);
    fsdp.save(dir, *opt, train::TrainingPosition{0, kSaveAt, kSaveAt});
    auto full = fsdp.full_state_dict();
    if (rank == 0) saved = std::move(full);
  });
  return saved;
}

class FsdpCheckpointTest : public ::testing::TestWithParam<Net> {
 protected:
  void SetUp() override { ::torch::set_num_threads(1); }
};

TEST_P(FsdpCheckpointTest, ASavedWorldLoadsAtAnotherAndTrainingContinuesAsUninterrupted) {
  // The conv net's units (30, 140, 324 parameters) and the MLP's (315, 112, 62) do not divide by 3 or 4:
  // shards with padding, whose pieces straddle parameters differently at each world size. The conv net
  // steps AdamW and the MLP SGD with momentum, whose state the continuation needs.
  const Net net = GetParam();
  for (const auto& worlds : std::vector<std::pair<int, int>>{{4, 2}, {4, 3}, {2, 4}}) {
    const int save_world = worlds.first, load_world = worlds.second;  // no structured binding: lambdas capture them
    SCOPED_TRACE(fmt::format("saved at {} ranks, loaded at {}", save_world, load_world));
    cohort::test::TempDir tmp;
    const auto saved = train_and_save(net, save_world, tmp.path());
    ASSERT_TRUE(std::filesystem::exists(fmt::format("{}/zero/step-{}/shard-{}-of-{}.bin", tmp.path(), kSaveAt,
                                                    save_world - 1, save_world)));
    const auto want = uninterrupted(net, load_world, kTotalSteps);
    const auto initial = initial_weights(net);
    auto comms = ThreadCommunicator::make_world(load_world);
    run_ranks(load_world, [&](int rank) {
      auto model = model_with(net, initial, rank);
      FullyShardedDataParallel fsdp(model, comms[size_t(rank)], units_for(net, true));
      auto opt = make_optimizer(net, fsdp.parameters());
      const auto position = fsdp.load(tmp.path(), *opt);
      ASSERT_TRUE(position.has_value());
      EXPECT_EQ(position->global_step, kSaveAt);
      const auto loaded = fsdp.full_state_dict();
      ASSERT_EQ(loaded.size(), saved.size());
      for (size_t i = 0; i < saved.size(); ++i)
        EXPECT_TRUE(::torch::equal(loaded[i].second, saved[i].second)) << "rank " << rank << ", " << saved[i].first;
      train_steps(net, fsdp, *opt, rank, load_world, kSaveAt, kTotalSteps);
      expect_weights(fsdp.full_state_dict(), want, fmt::format("rank {}", rank));
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Nets, FsdpCheckpointTest, ::testing::Values(Net::kMlp, Net::kConv),
                         [](const auto& info) { return std::string(name_of(info.param)); });

TEST_F(FsdpUnitsTest, AFailedCheckpointLoadNamesTheFileAndLeavesModelAndOptimizerAsTheyWere) {
  cohort::test::TempDir tmp;
  const std::string good = tmp.path() + "/good";
  train_and_save(Net::kConv, 2, good);
  const std::string shard1 = fmt::format("/zero/step-{}/shard-1-of-2.bin", kSaveAt);
  // A checkpoint whose shard of rank 1 is missing, and one whose shard of rank 1 lost its last value.
  const std::string missing = tmp.path() + "/missing", cut = tmp.path() + "/cut";
  for (const auto& dir : {missing, cut})
    std::filesystem::copy(good, dir, std::filesystem::copy_options::recursive);
  std::filesystem::remove(missing + shard1);
  const auto size = std::filesystem::file_size(cut + shard1);
  std::filesystem::resize_file(cut + shard1, size - 4);

  const int world = 2;
  const auto initial = initial_weights(Net::kConv);
  auto comms = ThreadCommunicator::make_world(world);
  run_ranks(world, [&](int rank) {
    // Trained one step on other data than the checkpoint's, so that its weights and AdamW state exist.
    auto model = model_with(Net::kConv, initial, rank);
    FullyShardedDataParallel fsdp(model, comms[size_t(rank)], units_for(Net::kConv, true));
    auto opt = make_optimizer(Net::kConv, fsdp.parameters());
    train_steps(Net::kConv, fsdp, *opt, rank, world, 7, 8);
    const auto before = fsdp.full_state_dict();
    // The optimizer's state, in its map's order (its keys stay those of the same shard tensors).
    auto moments_of = [&] {
      std::vector<::torch::Tensor> out;
      for (const auto& entry : opt->state())
        out.push_back(static_cast<const ::torch::optim::AdamWParamState&>(*entry.second).exp_avg().clone());
      return out;
    };
    const auto moments = moments_of();
    ASSERT_EQ(moments.size(), fsdp.parameters().size());
    auto expect_failure = [&](const std::string& dir, ::torch::optim::Optimizer& o, FullyShardedDataParallel& f,
                              const std::string& says) {
      try {
        f.load(dir, o);
        ADD_FAILURE() << "no error loading " << dir;
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      }
    };
    expect_failure(missing, *opt, fsdp, "shard-1-of-2.bin: the shard of rank 1 of 2 is missing");
    expect_failure(cut, *opt, fsdp, fmt::format("shard-1-of-2.bin: {} bytes, not the {} its header says", size - 4, size));
    // Another kind of optimizer over the same shards.
    ::torch::optim::SGD sgd(fsdp.parameters(), ::torch::optim::SGDOptions(0.1).momentum(0.9));
    expect_failure(good, sgd, fsdp, "checkpoint.bin: the checkpoint holds adamw state; this optimizer is sgd");
    // The same model with its last layer one output wider: a size mismatch, named.
    {
      auto other = nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 3, 3)), nn::ReLU(), nn::Conv2d(nn::Conv2dOptions(3, 5, 3)),
                                  nn::ReLU(), nn::Flatten(), nn::Linear(80, 5));
      FullyShardedDataParallel wider(other, comms[size_t(rank)], units_for(Net::kConv, true));
      auto wider_opt = make_optimizer(Net::kConv, wider.parameters());
      expect_failure(good, *wider_opt, wider,
                     "shard-0-of-2.bin: written for another model: its parameter 4 is 5.weight of 320 elements, this "
                     "model's is 5.weight of 400 elements");
    }
    // Nothing changed: the weights, and the optimizer's state.
    const auto after = fsdp.full_state_dict();
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(::torch::equal(after[i].second, before[i].second)) << "rank " << rank << ", " << before[i].first;
    const auto moments_after = moments_of();
    ASSERT_EQ(moments_after.size(), moments.size());
    for (size_t u = 0; u < moments.size(); ++u)
      EXPECT_TRUE(::torch::equal(moments_after[u], moments[u])) << "rank " << rank << ", state " << u;
    // And the good checkpoint still loads.
    EXPECT_TRUE(fsdp.load(good, *opt).has_value());
  });
}

// ---- buffers and wire compression ----

TEST_F(FsdpUnitsTest, BuffersAreBroadcastFromRankZeroBeforeEachTrainingForwardAsUnderDdp) {
  // Batch norm's running statistics follow each rank's own batches; DDP broadcasts rank 0's before every
  // training forward, and FSDP does the same: each rank's buffers after training equal that rank's under
  // DDP. Without the broadcast, rank 1's statistics would be its own batches' alone.
  const int world = 2;
  const Net net = Net::kNorm;
  const auto initial = initial_weights(net);
  auto run = [&](bool fsdp_on, bool broadcast) {
    std::vector<std::vector<::torch::Tensor>> buffers(world);
    std::vector<::torch::Tensor> weights;
    auto comms = ThreadCommunicator::make_world(world);
    run_ranks(world, [&](int rank) {
      auto model = model_with(net, initial, rank);
      if (rank == 1) {
        ::torch::NoGradGuard g;
        for (auto& b : model->buffers()) b.fill_(5);  // differs from rank 0's until the wrapper broadcasts
      }
      std::unique_ptr<FullyShardedDataParallel> fsdp;
      std::unique_ptr<DistributedDataParallel> ddp;
      std::vector<::torch::Tensor> params;
      if (fsdp_on) {
        FSDPOptions o = units_for(net, true);
        o.broadcast_buffers = broadcast;
        fsdp = std::make_unique<FullyShardedDataParallel>(model, comms[size_t(rank)], o);
        for (auto& b : model->buffers()) {
          // At wrap, whatever broadcast_buffers says (DDP's constructor does the same).
          EXPECT_NE(b.to(::torch::kDouble).sum().item<double>(), 5.0 * b.numel()) << "rank " << rank;
        }
        params = fsdp->parameters();
      } else {
        ddp = std::make_unique<DistributedDataParallel>(model, comms[size_t(rank)]);
        params = ddp->parameters();
      }
      auto opt = make_optimizer(net, params);
      for (int it = 0; it < kSteps; ++it) {
        auto b = batch(net, it, rank, world);
        opt->zero_grad();
        auto out = fsdp_on ? fsdp->forward(b.x) : ddp->forward(b.x);
        ::torch::nn::functional::cross_entropy(out, b.y).backward();
        opt->step();
      }
      for (auto& b : model->buffers()) buffers[size_t(rank)].push_back(b.clone());
      std::vector<::torch::Tensor> mine;
      if (fsdp_on) {
        for (auto& entry : fsdp->full_state_dict()) mine.push_back(entry.second);  // collective
      } else {
        for (auto& p : model->parameters()) mine.push_back(p.detach().clone());
      }
      if (rank == 0) weights = mine;
    });
    return std::make_pair(buffers, weights);
  };
  const auto ddp = run(false, true);
  const auto fsdp = run(true, true);
  const auto unsynced = run(true, false);
  for (int rank = 0; rank < world; ++rank) {
    const auto& want = ddp.first[size_t(rank)];
    ASSERT_EQ(want.size(), 3u) << "running_mean, running_var, num_batches_tracked";
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(::torch::allclose(fsdp.first[size_t(rank)][i].to(::torch::kDouble), want[i].to(::torch::kDouble), kRtol,
                                    kAtol))
          << "rank " << rank << ", buffer " << i;
  }
  for (size_t i = 0; i < ddp.second.size(); ++i)
    EXPECT_TRUE(::torch::allclose(fsdp.second[i], ddp.second[i], kRtol, kAtol)) << "weight " << i;
  // The option off: rank 1's running mean is its own batches' only, not DDP's.
  EXPECT_FALSE(::torch::allclose(unsynced.first[1][0], ddp.first[1][0], kRtol, kAtol));
}

TEST_F(FsdpUnitsTest, CompressedGradientReduceScatterMatchesDdpWithTheSameCompression) {
  // The gradients travel as 16-bit floats, as DDP's compressed buckets: each rank's gradient rounded, the
  // mean rounded. FSDP's reduce-scatter rounds the same values as DDP's allreduce, so the weights agree
  // with DDP under the same compression to float rounding, and differ from the uncompressed run by what
  // 16 bits lose: float16 (11 bits of mantissa) within 1e-3, bfloat16 (8 bits) within DDP's bf16 tolerance.
  const Net net = Net::kMlp;
  for (const int world : {2, 3}) {
    const auto plain = ddp_weights(net, world);
    for (const auto compression : {train::WireCompression::kFloat16, train::WireCompression::kBFloat16}) {
      SCOPED_TRACE(fmt::format("{} ranks, {}", world, train::compression_name(compression)));
      DDPOptions d;
      d.compression = compression;
      const auto want = ddp_weights(net, world, kNoClip, nullptr, d);
      const double rtol = compression == train::WireCompression::kFloat16 ? 1e-3 : 2e-2;
      const double atol = compression == train::WireCompression::kFloat16 ? 1e-4 : 2e-3;
      const auto initial = initial_weights(net);
      auto comms = ThreadCommunicator::make_world(world);
      run_ranks(world, [&](int rank) {
        auto model = model_with(net, initial, rank);
        FSDPOptions o = units_for(net, true);
        o.compression = compression;
        FullyShardedDataParallel fsdp(model, comms[size_t(rank)], o);
        auto opt = make_optimizer(net, fsdp.parameters());
        train_steps(net, fsdp, *opt, rank, world, 0, kSteps);
        for (auto& shard : fsdp.parameters()) EXPECT_EQ(shard.grad().scalar_type(), ::torch::kFloat32);
        const auto got = fsdp.full_state_dict();
        expect_weights(got, want, fmt::format("rank {}, against DDP with the same compression", rank));
        double max_from_plain = 0;
        for (size_t i = 0; i < plain.size(); ++i) {
          EXPECT_TRUE(::torch::allclose(got[i].second, plain[i], rtol, atol)) << got[i].first;
          max_from_plain = std::max(max_from_plain, (got[i].second - plain[i]).abs().max().item<double>());
        }
        EXPECT_GT(max_from_plain, kAtol) << "the gradients were not rounded to 16 bits";
      });
    }
  }
}

}  // namespace
}  // namespace cohort::torch
