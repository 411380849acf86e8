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

enum class Net { kMlp, kConv };
const char* name_of(Net n) { return n == Net::kMlp ? "mlp" : "conv"; }

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
nn::Sequential make(Net n) { return n == Net::kMlp ? make_mlp() : make_conv(); }

// The MLP's units by size (two Linear layers; LayerNorm and the last Linear form the root unit), the
// conv net's by type (both convolutions; the Linear is the root).
FSDPOptions units_for(Net n, bool reshard) {
  FSDPOptions o;
  o.reshard_after_forward = reshard;
  if (n == Net::kMlp) o.auto_wrap_min_params = 100;
  else o.auto_wrap_module_types = {"torch::nn::Conv2dImpl"};
  return o;
}

struct Batch {
  ::torch::Tensor x, y;
};
Batch batch(Net n, int it, int rank, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3000 + it);
  ::torch::Tensor x = n == Net::kMlp ? ::torch::randn({kGlobalBatch, 20}, gen) : ::torch::randn({kGlobalBatch, 1, 8, 8}, gen);
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
std::vector<::torch::Tensor> ddp_weights(Net n, int world, double max_norm = kNoClip, std::vector<double>* norms = nullptr) {
  const auto initial = initial_weights(n);
  std::vector<::torch::Tensor> out;
  auto comms = ThreadCommunicator::make_world(world);
  run_ranks(world, [&](int rank) {
    auto model = model_with(n, initial, rank);
    DistributedDataParallel ddp(model, comms[size_t(rank)]);
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

}  // namespace
}  // namespace cohort::torch
