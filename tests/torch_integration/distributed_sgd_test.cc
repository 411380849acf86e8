// cohort::torch::DistributedSGD: the SGD step fused with the averaging of gradients gives the weights
// of torch's SGD on the concatenated batch, on real communicators (ranks as threads on one host, so
// the fused one-pass path runs on shared memory) and, not fused, where there is no one-pass path (the
// ThreadCommunicator test double). Same tolerance as ddp_test.cc (float32 rounding of a reordered sum).
#include <gtest/gtest.h>

#include "cohort/torch/distributed_sgd.h"
#include "collectives/shm/group.h"
#include "comm/communicator_impl.h"
#include "store/memory_store.h"
#include "support/test_support.h"
#include "train/thread_communicator.h"

namespace cohort::torch {
namespace {

using cohort::test::run_ranks;
namespace nn = ::torch::nn;

constexpr double kRtol = 1e-4, kAtol = 1e-6;

nn::Sequential make_mlp() {
  return nn::Sequential(nn::Linear(20, 16), nn::ReLU(), nn::Linear(16, 8), nn::ReLU(), nn::Linear(8, 4));
}

struct Batch {
  ::torch::Tensor x, y;
};
Batch global_batch(int it, int world, int per_rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + it);
  return {::torch::randn({world * per_rank, 20}, gen), ::torch::randint(0, 4, {world * per_rank}, gen, ::torch::kLong)};
}

struct Case {
  int world = 2;
  bool real_communicator = true;
  std::string transport = "auto";  // of the real communicator
  ::torch::optim::SGDOptions sgd{0.1};
  bool average_before_step = false;  // finish_gradient_sync() first (to clip, say): torch's step
  bool replace_a_parameter = false;  // Tensor::set_ mid-training (what Module::load does)
  bool expect_fused = true;
  bool ddp_zero_grad = false;  // clear with DistributedDataParallel::zero_grad(), as the examples do
};

void check_matches_torch_sgd(const Case& c) {
  const int per_rank = 4, iters = 4;
  ::torch::manual_seed(0);
  auto ref = make_mlp();
  std::vector<::torch::Tensor> initial;
  for (auto& p : ref->parameters()) initial.push_back(p.detach().clone());
  {
    ::torch::optim::SGD opt(ref->parameters(), c.sgd);
    for (int it = 0; it < iters; ++it) {
      auto b = global_batch(it, c.world, per_rank);
      opt.zero_grad();
      ::torch::nn::functional::cross_entropy(ref->forward(b.x), b.y).backward();
      opt.step();
    }
  }
  auto store = make_memory_store();
  auto doubles = cohort::test::ThreadCommunicator::make_world(c.world);
  run_ranks(c.world, [&](int rank) {
    std::shared_ptr<Communicator> comm = doubles[rank];
    if (c.real_communicator) {
      CommOptions o;
      o.timeout = std::chrono::seconds(60);
      o.transport = c.transport;
      comm = Communicator::create(store, rank, c.world, o);
    }
    auto model = make_mlp();
    if (rank == 0) {
      ::torch::NoGradGuard g;
      auto ps = model->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(initial[i]);
    }
    DDPOptions options;
    options.first_bucket_cap_bytes = 200;  // several buckets, rebuilt after the first step
    options.bucket_cap_bytes = 600;
    DistributedDataParallel ddp(model, comm, options);
    DistributedSGD opt(ddp, c.sgd);
    ASSERT_EQ(opt.fused(), c.expect_fused) << opt.why_not_fused();
    auto ps = model->parameters();
    for (int it = 0; it < iters; ++it) {
      auto b = global_batch(it, c.world, per_rank);
      auto x = b.x.narrow(0, rank * per_rank, per_rank), y = b.y.narrow(0, rank * per_rank, per_rank);
      if (c.ddp_zero_grad) {
        ddp.zero_grad();
        // Released, bucket views included: backward's fresh gradient is copied into the bucket (one
        // read and one write) instead of a memset of the bucket and an add into it.
        for (size_t i = 0; i < ps.size(); ++i)
          ASSERT_FALSE(ps[i].grad().defined()) << "rank " << rank << " iteration " << it << " param " << i;
      } else {
        opt.zero_grad();
      }
      ::torch::nn::functional::cross_entropy(ddp->forward(x), y).backward();
      // This rank's own gradient, in its bucket slot, waiting for the fused step (the first iteration's
      // buckets are rebuilt in ready order after it, so the views are checked from the second).
      if (c.ddp_zero_grad && c.expect_fused && it > 0) {
        for (size_t i = 0; i < ps.size(); ++i) ASSERT_TRUE(ddp.gradient_is_bucket_view(i)) << "param " << i;
      }
      if (c.average_before_step) ddp.finish_gradient_sync();
      opt.step();
      if (c.replace_a_parameter && it == 1) {
        ::torch::NoGradGuard g;
        ps[0].set_(ps[0].detach().clone());
        ASSERT_FALSE(ddp.parameter_is_bucket_view(0));
      }
    }
    auto rp = ref->parameters();
    for (size_t i = 0; i < ps.size(); ++i)
      EXPECT_TRUE(::torch::allclose(ps[i], rp[i], kRtol, kAtol))
          << "rank " << rank << " weights " << i << " max diff " << (ps[i] - rp[i]).abs().max().item<float>();
    if (c.expect_fused && !c.average_before_step) {
      // The parameters live in the buckets (and moved there again after the rebuild and the set_).
      for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(ddp.parameter_is_bucket_view(i)) << "param " << i;
      EXPECT_TRUE(ddp.sync().buckets_rebuilt());
      if (c.real_communicator) {
        // One host: every step took the one-pass path on shared memory, with one allreduce_update
        // for all of the model's buckets (two rounds of synchronisation per step, not two per bucket).
        auto* impl = dynamic_cast<comm::CommunicatorImpl*>(comm.get());
        ASSERT_TRUE(impl && impl->shm_group());
        EXPECT_GT(ddp.sync().bucket_layout().size(), 1u) << "rank " << rank;
        EXPECT_EQ(impl->shm_group()->fused_updates(), uint64_t(iters)) << "rank " << rank;
        EXPECT_EQ(ddp.stats().allreduces, iters) << "rank " << rank;
      }
    }
  });
}

class DistributedSgdTest : public ::testing::Test {
 protected:
  void SetUp() override { ::torch::set_num_threads(1); }
};

TEST_F(DistributedSgdTest, FusedStepGivesTorchsSgdWeightsOnTwoAndThreeRanks) {
  check_matches_torch_sgd({.world = 2});
  check_matches_torch_sgd({.world = 3});
}

TEST_F(DistributedSgdTest, DdpZeroGradReleasesTheBucketViewsAndTheFusedStepStaysRight) {
  check_matches_torch_sgd({.world = 2, .ddp_zero_grad = true});
  check_matches_torch_sgd({.world = 3, .ddp_zero_grad = true});
}

TEST_F(DistributedSgdTest, WeightDecayIsFusedToo) {
  check_matches_torch_sgd({.world = 2, .sgd = ::torch::optim::SGDOptions(0.1).weight_decay(0.01)});
}

TEST_F(DistributedSgdTest, WithoutOneHostsSharedMemoryDdpsOverlappedAveragingStays) {
  // The test double, like ranks on several hosts, has no one-pass path (one_pass_update() is false).
  check_matches_torch_sgd({.world = 3, .real_communicator = false, .expect_fused = false});
}

TEST_F(DistributedSgdTest, OverTcpDdpsOverlappedAveragingStays) {
  check_matches_torch_sgd({.world = 2, .transport = "tcp", .expect_fused = false});
}

TEST_F(DistributedSgdTest, AveragingBeforeTheStepFallsBackToTorchsStep) {
  check_matches_torch_sgd({.world = 2, .average_before_step = true});
}

TEST_F(DistributedSgdTest, AParameterReplacedMidTrainingIsMovedBackIntoItsBucket) {
  check_matches_torch_sgd({.world = 2, .replace_a_parameter = true});
}

TEST_F(DistributedSgdTest, MomentumIsNotFusedAndStillRight) {
  check_matches_torch_sgd({.world = 2, .sgd = ::torch::optim::SGDOptions(0.1).momentum(0.9), .expect_fused = false});
}

TEST_F(DistributedSgdTest, AParameterTheDdpDoesNotSynchroniseStopsTheFusion) {
  auto store = make_memory_store();
  run_ranks(2, [&](int rank) {
    CommOptions o;
    o.timeout = std::chrono::seconds(60);
    auto comm = Communicator::create(store, rank, 2, o);
    DistributedDataParallel ddp(make_mlp(), comm);
    DistributedSGD opt(ddp, ::torch::optim::SGDOptions(0.1));
    EXPECT_TRUE(opt.fused()) << opt.why_not_fused();
    opt.param_groups().front().params().push_back(::torch::zeros({3}, ::torch::requires_grad()));
    EXPECT_EQ(opt.why_not_fused(), "a parameter that the DDP does not synchronise");
    opt.param_groups().front().params().pop_back();
    opt.param_groups().front().params().pop_back();  // and one of the DDP's left out
    EXPECT_EQ(opt.why_not_fused(), "the optimizer leaves out some of the DDP's parameters");
  });
}

TEST_F(DistributedSgdTest, OneRankIsTorchsSgd) {
  check_matches_torch_sgd({.world = 1, .expect_fused = false});
}

}  // namespace
}  // namespace cohort::torch
