// cohort::torch::FullyShardedDataParallel and glibc's heap: a gathered unit, a flattened gradient and a
// unit's activations are allocated and freed around every unit of every step, and what glibc keeps
// resident of them decides FSDP's peak memory as much as the formula's live bytes do
// (docs/training.md, "Fully sharded data parallel"). One rank, over the ThreadCommunicator test double.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "cohort/error.h"
#include "cohort/torch/fsdp.h"
#include "train/thread_communicator.h"

namespace cohort::torch {
namespace {

using cohort::test::ThreadCommunicator;
namespace nn = ::torch::nn;

class FsdpHeapTest : public ::testing::Test {
 protected:
  void SetUp() override { ::torch::set_num_threads(1); }
};

// Each unit's gathered parameters are allocated before its forward and freed after its backward, between
// the activations. With glibc's rising mmap threshold (a freed block of 24 MiB lifts it to 24 MiB) they
// come from the heap, whose holes stay resident after free: BERT-base peaked 550 MB above its live
// memory per rank. FSDP fixes the threshold (FSDPOptions::mmap_threshold_bytes, 1 MiB by default): a
// gathered unit is a mapping of its own while gathered, and gone from the process after its backward.
TEST_F(FsdpHeapTest, AGatheredUnitIsMappedOnItsOwnAndUnmappedAfterItsBackward) {
#if !defined(__GLIBC__)
  GTEST_SKIP() << "glibc's malloc only";
#else
  void* big = std::malloc(size_t{24} << 20);  // raises glibc's dynamic threshold when it is not fixed
  static_cast<volatile char*>(big)[0] = 1;
  std::free(big);
  auto comms = ThreadCommunicator::make_world(1);
  // A 4 MiB unit (1024 x 1024 weights and the bias); the head is the root unit.
  nn::Sequential model(nn::Linear(1024, 1024), nn::ReLU(), nn::Linear(1024, 4));
  FSDPOptions options;
  options.auto_wrap_min_params = 1'000'000;
  options.reshard_after_forward = false;  // gathered from its forward to its backward
  FullyShardedDataParallel fsdp(model, comms[0], options);
  ASSERT_EQ(fsdp.units().size(), 2u);
  const size_t unit_bytes = static_cast<size_t>(fsdp.units()[0].numel) * sizeof(float);
  auto x = ::torch::randn({12, 1024});
  auto y = ::torch::randint(0, 4, {12});
  const size_t mapped_before = mallinfo2().hblkhd;  // bytes in blocks malloc mapped on their own
  auto loss = ::torch::nn::functional::cross_entropy(fsdp.forward(x), y);
  ASSERT_TRUE(fsdp.gathered(0));
  EXPECT_GE(mallinfo2().hblkhd, mapped_before + unit_bytes) << "the gathered unit came from the heap";
  loss.backward();
  ASSERT_FALSE(fsdp.gathered(0));
  // Its .grad (4 MiB, a mapping too) is freed when flattened; the shard's 4 MiB .grad stays (1 rank).
  EXPECT_LT(mallinfo2().hblkhd, mapped_before + unit_bytes + unit_bytes / 2) << "the gathered unit is still mapped";

  FSDPOptions too_high;
  too_high.mmap_threshold_bytes = size_t{4} << 30;  // mallopt takes an int
  try {
    FullyShardedDataParallel refused(nn::Sequential(nn::Linear(4, 4)), comms[0], too_high);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("mmap_threshold_bytes 4294967296 is above"), std::string::npos) << e.what();
  }
#endif
}

#if defined(__GLIBC__)
// Resident anonymous memory that malloc has no block in use in: the heap's free holes, plus what is not
// malloc's at all (thread stacks, libraries' own mappings), which does not change within a test.
int64_t resident_not_in_use() {
  std::ifstream status("/proc/self/status");
  int64_t anon_kb = -1;
  for (std::string line; std::getline(status, line);)
    if (line.rfind("RssAnon:", 0) == 0) anon_kb = std::stoll(line.substr(8));
  EXPECT_GE(anon_kb, 0) << "no RssAnon line in /proc/self/status";
  const auto info = mallinfo2();
  return anon_kb * 1024 - static_cast<int64_t>(info.uordblks + info.hblkhd);
}

// Calls `at_backward` when backward reaches its input: after the backward of what follows it.
struct BackwardProbeImpl : nn::Module {
  explicit BackwardProbeImpl(std::function<void()> f) : at_backward(std::move(f)) {}
  ::torch::Tensor forward(::torch::Tensor x) {
    if (x.requires_grad()) x.register_hook([this](const ::torch::Tensor&) { at_backward(); });
    return x;
  }
  std::function<void()> at_backward;
};
TORCH_MODULE(BackwardProbe);

// A Linear and `n` tanh, each saving its output for backward.
struct TanhChainImpl : nn::Module {
  explicit TanhChainImpl(int n) : linear(register_module("linear", nn::Linear(256, 256))), n(n) {}
  ::torch::Tensor forward(::torch::Tensor x) {
    x = linear(x);
    for (int i = 0; i < n; ++i) x = ::torch::tanh(x);
    return x;
  }
  nn::Linear linear;
  int n;
};
TORCH_MODULE(TanhChain);
#endif

// A unit's backward frees its activations, small blocks of the heap (below FSDP's 1 MiB mmap
// threshold) under the gradients made after them: glibc keeps them resident until the heap is trimmed.
// BERT-base's backward ends with its tied embedding's three gradients (the decoder's, the embedding's,
// their sum); with the heap trimmed only after backward, 140 MB of every layer's freed activations were
// still resident then. FSDP hands them back after each unit's backward.
TEST_F(FsdpHeapTest, TheActivationsAUnitsBackwardFreedAreHandedBackBeforeTheNextUnitsBackward) {
#if !defined(__GLIBC__)
  GTEST_SKIP() << "glibc's malloc only";
#else
  int64_t before = 0, at_probe = 0;
  size_t heap_free_at_probe = 0;
  nn::Sequential model(nn::Linear(256, 256), BackwardProbe([&] {
                         at_probe = resident_not_in_use();
                         heap_free_at_probe = mallinfo2().fordblks;
                       }),
                       TanhChain(192), nn::Linear(256, 4));  // 192 outputs of 512 KiB: 96 MiB of heap blocks
  auto comms = ThreadCommunicator::make_world(1);
  FullyShardedDataParallel fsdp(model, comms[0], FSDPOptions{}, {model->ptr(0), model->ptr(2)});
  ASSERT_EQ(fsdp.units().size(), 3u);
  auto x = ::torch::randn({512, 256});
  before = resident_not_in_use();
  fsdp.forward(x).pow(2).mean().backward();
  ASSERT_GT(heap_free_at_probe, size_t{64} << 20) << "the tanh outputs were not freed into the heap by then";
  // Without the trim after the second unit's backward, about the 96 MiB of tanh outputs stay resident.
  EXPECT_LT(at_probe - before, int64_t{24} << 20)
      << (at_probe - before) / (1 << 20) << " MiB more resident memory than malloc has in use, at the first unit's backward";
#endif
}

}  // namespace
}  // namespace cohort::torch
