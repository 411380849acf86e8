#pragma once
// cohort::torch — data-parallel training for the libtorch C++ frontend.
//
// The four steps of a one-card -> data-parallel conversion, in C++:
//   auto comm = cohort::Communicator::from_env();                            // 1. rank from the env
//   cohort::torch::DistributedSampler sampler(n, comm->size(), comm->rank()); // 2. sampler
//   cohort::torch::DistributedDataParallel model(Net(), comm);               // 3. wrap the model
//   for (auto idx : batches of sampler.indices()) { ... }                     // 4. sharded loading
// and the loop itself is unchanged:
//   optimizer.zero_grad(); auto loss = f(model->forward(x), y); loss.backward(); optimizer.step();
//
// How gradients are synchronised: at construction the wrapper broadcasts parameters and buffers
// from rank 0, checks that every rank has the same parameter names and shapes, and adds a post
// hook to every parameter's gradient accumulator (the node that writes .grad). Each hook hands the
// accumulated gradient to train::GradientSync, whose buckets start their allreduce as soon as they
// are full, overlapping the rest of backward. The hook of the LAST parameter waits for every
// bucket and writes the averaged gradients back into .grad, so all gradients are synchronised
// when loss.backward() returns — no finish call in the user's loop. (libtorch 1.13's C++ API has
// no "final autograd callback"; the last-hook rule needs every parameter to get a gradient, which
// is why a parameter without one is an error, reported at the next forward() or by
// finish_gradient_sync(), unless find_unused_parameters is set: then forward() walks the autograd
// graph from the output, and unreachable parameters contribute zeros up front.)
//
// Parameters replaced in place with Tensor::set_ (torch::nn::Module::load does that) get a new
// gradient accumulator; forward() notices and moves the hook, so loading a checkpoint after
// wrapping is fine.
//
// A model on a GPU (libtorch with CUDA): the buckets live in that GPU's memory and NCCL reduces them
// (cohort/gpu.h); a host communicator passed in is wrapped with gpu::make_device_communicator, so the
// four steps above are unchanged. NCCL runs on the communicator's blocking stream, which is ordered
// after the backward kernels queued on the default stream; the last hook waits for the reductions.
// docs/gpu.md has the rules.
//
// Not thread-safe: one backward at a time per wrapper (the CPU autograd engine runs hooks on the
// thread that called backward(); the CUDA one on its device thread, one at a time).

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/torch/module_holder.h"
#include "cohort/train/checkpoint.h"
#include "cohort/train/grad_sync.h"
#include "cohort/train/sampler.h"
#include "cohort/train/sgd.h"

namespace cohort::torch {

struct DDPOptions {
  size_t bucket_cap_bytes = size_t{25} << 20;
  size_t first_bucket_cap_bytes = size_t{1} << 20;
  train::WireCompression compression = train::WireCompression::kNone;
  bool find_unused_parameters = false;
  bool rebuild_buckets = true;
  // torch's gradient_as_bucket_view: each parameter's .grad becomes a view of its slot in the
  // communication bucket (from its first synchronised backward on, again after the bucket rebuild and
  // after each zero_grad() that released it), so the average is never copied back into .grad, and a
  // gradient accumulated into the view (no_sync, torch's zero_grad) is not copied into it either. The .grad
  // tensor object changes when it is rebound: code holding an old .grad reference must re-read it.
  // Off: .grad keeps its own memory and is copied both ways.
  bool gradient_as_bucket_view = true;
  // torch's broadcast_buffers: before each forward that records gradients (training, sync enabled),
  // the module's buffers (batch norm's running statistics) are broadcast from rank 0, so every rank
  // normalises with the same statistics and a checkpoint of rank 0 holds them. One broadcast per
  // buffer dtype (the buffers are packed), not one per buffer.
  bool broadcast_buffers = true;
  // A model on the CPU with glibc: keep the heap's free memory resident from one step to the next.
  // By itself glibc hands the top of its heap back whenever a free leaves more than its trim threshold
  // there (twice its mmap threshold, which rises with the largest block freed): the activations that
  // backward frees, at the top since forward allocated them last, went back to the system at the end of
  // every step and the next forward faulted each page in again (BERT-mini: 3,066 faults a step, about
  // 1.6 us each on a KVM guest, 4-9 % of the step's CPU; docs/performance.md, "Data-parallel training").
  // On: at construction glibc's own trimming is turned off (M_TRIM_THRESHOLD) and its mmap threshold
  // fixed at 32 MiB, the most glibc's rise gives it (fixing either stops the rise of both). The heap is
  // then handed back only where the wrapper does it itself (return_freed_memory: the parameters' storage
  // moved into buckets, the holes before the bucket rebuild; stage 2's return_heap_growth), and the
  // process otherwise keeps its largest step's heap resident. These are the process's settings:
  // an FSDP wrapper constructed later turns the trimming back on (it needs the top of the heap trimmed).
  bool keep_heap_resident = true;
};

class DistributedDataParallel {
 public:
  // `module`: a ModuleHolder (Linear, Sequential, a TORCH_MODULE) or a shared_ptr to a module. A
  // forward of one tensor is forward(x); any other goes through forward_with(). Collective over `comm`.
  template <typename ModuleType>
  DistributedDataParallel(ModuleType module, std::shared_ptr<Communicator> comm, DDPOptions options = {})
      : comm_(std::move(comm)), options_(options) {
    auto ptr = holder_ptr(std::move(module));
    module_ = ptr;
    if constexpr (requires(const ::torch::Tensor& x) { ptr->forward(x); }) {
      forward_ = [ptr](const ::torch::Tensor& x) -> ::torch::Tensor { return ptr->forward(x); };
    } else {
      // A forward of other arguments (a BERT's ids and masked positions): forward_with() runs it.
      forward_ = [](const ::torch::Tensor&) -> ::torch::Tensor {
        throw InvalidArgument("DDP: this module's forward takes other arguments: call forward_with([&] { return "
                              "module->forward(...); })");
      };
    }
    init();
  }
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  ::torch::Tensor forward(const ::torch::Tensor& input) {
    return forward_with([&] { return forward_(input); });
  }
  // For modules whose forward takes other arguments: ddp.forward_with([&] { return net->forward(a, b); }).
  template <typename Fn>
  ::torch::Tensor forward_with(Fn&& run_forward) {
    before_forward();
    ::torch::Tensor out = run_forward();
    after_forward(out);
    return out;
  }
  // Sugar so that `model->forward(x)` reads like a ModuleHolder.
  DistributedDataParallel* operator->() { return this; }

  std::shared_ptr<::torch::nn::Module> module() const { return module_; }
  std::vector<::torch::Tensor> parameters() const { return module_->parameters(); }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }

  // Waits for any bucket still in flight and writes the averaged gradients back. Normally a no-op:
  // the last gradient hook already did it. Throws naming a parameter that received no gradient.
  void finish_gradient_sync();

  // Clears the gradients before the next backward, as torch 2.x's optimizer.zero_grad() (set_to_none)
  // does: every .grad is released, so that backward hands over its fresh gradient instead of adding
  // it to zeros. A gradient that was a view of its bucket slot (gradient_as_bucket_view, the fused
  // update) becomes one again in backward: its hook copies the fresh gradient into the slot (one read
  // and one write, where zeroing the view in place cost a memset and backward's add: issue 51). Right
  // before the bucket rebuild (after the first iteration) this frees the old buckets before the new
  // ones are allocated (GradientSync::rebuild_pending).
  // libtorch 1.13's optimizer.zero_grad() zeroes every gradient: one memset and one add
  // over the whole model each step that Python's loop does not pay (on one process that was 8-20 %
  // of the MLP example's step).
  void zero_grad();

  // Gradient accumulation: while the guard lives, backward only accumulates locally.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp) : guard_(ddp.sync()) {}
   private:
    train::NoSyncGuard guard_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // The fused SGD step (DistributedSGD turns it on; docs/training.md, "The fused SGD step"): the
  // parameters become views of bucket memory too, backward only collects the gradients, and
  // step_fused() averages them and applies the step in one pass. Collective. No-op on one rank.
  void enable_fused_update();
  bool fused_update() const { return sync_->fused_update(); }
  // Reduces this iteration's gradients fused with `step` into the parameters (every rank). False when
  // there is nothing to reduce (no backward since the last step, or it ran under no_sync, or
  // finish_gradient_sync() already averaged the gradients): the caller then steps as usual.
  bool step_fused(const train::SgdStep& step);
  // Whether parameter `index` currently is a view of its parameter slot (fused update, sharded mode).
  bool parameter_is_bucket_view(size_t index) const;

  // Sharded mode (ZeRO; ShardedOptimizer turns it on, collective): the buckets are reduce-scattered
  // instead of allreduced, each rank keeps its averaged chunk of every bucket, and the parameters
  // become views of bucket memory so that the allgather of the updated chunks lands in them. Stage 2
  // also frees each parameter's .grad as soon as its gradient is in its bucket. After backward, .grad
  // (stage 1) holds this rank's own gradient outside its chunks: ShardedOptimizer::clip_grad_norm
  // clips the averaged one.
  void enable_sharding(int stage);
  int sharding_stage() const { return sync_->sharding_stage(); }

  train::GradientSync& sync() { return *sync_; }
  ::torch::Device device() const { return device_; }
  const train::GradSyncStats& stats() const { return sync_->stats(); }
  Communicator& communicator() { return *comm_; }
  // Whether parameter `index`'s .grad currently is a view of its bucket slot (gradient_as_bucket_view).
  bool gradient_is_bucket_view(size_t index) const;

 private:
  friend class ShardedOptimizer;  // re-binds the parameters after a checkpoint replaced them
  struct Hook;
  void init();
  void before_forward();
  void after_forward(const ::torch::Tensor& out);
  void on_gradient_ready(size_t index);
  void broadcast_buffers();
  void write_back(size_t index, const float* averaged);
  void bind_to_bucket(size_t index);
  // Fused update and sharded mode: makes every parameter a view of its slot, copying its values
  // there first (also after a checkpoint load replaced the tensors).
  void bind_parameters();
  // Hands the heap's free pages back to the system (malloc_trim), if it holds at least that much
  // free memory: after the model's storage moved into buckets, after the first optimizer step (at
  // zero_grad before the rebuild, or ShardedOptimizer's first step); stage 2 uses return_heap_growth.
  void return_freed_memory(size_t at_least_bytes = 0);
  // After each stage-2 step: hands the heap back only when its free memory grew by at least
  // `grown_by` bytes since the last time it did. The free heap a step leaves is mostly what the next
  // step takes again (forward's activations, backward's gradients); handed back every step, each page
  // of it faulted in again (BERT-mini: 16x the page faults of DDP's forward).
  // What keeps growing is the fragmentation stage 2's fresh gradients leave, which no step reuses.
  void return_heap_growth(size_t grown_by);
  size_t free_heap_at_trim_ = 0;  // the free heap after the last trim (a trim leaves the count as it was)

  std::function<::torch::Tensor(const ::torch::Tensor&)> forward_;
  std::shared_ptr<::torch::nn::Module> module_;
  std::shared_ptr<Communicator> comm_;
  DDPOptions options_;
  std::vector<::torch::Tensor> params_;
  std::vector<std::shared_ptr<::torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::unique_ptr<train::GradientSync> sync_;
  std::vector<::torch::Tensor> contiguous_grads_;  // holders for non-contiguous gradients
  ::torch::Device device_{::torch::kCPU};          // where the parameters (and buckets) are
};

// Broadcasts every parameter and buffer of `module` from rank 0 (done by the DDP constructor).
void broadcast_module(::torch::nn::Module& module, Communicator& comm);

// cohort's GPU collectives follow torch's current CUDA stream from now on (cohort::gpu::current_stream):
// each waits for what that stream had queued, and a wait orders that stream after it, as with
// ProcessGroupNCCL. DistributedDataParallel calls it for a model on a GPU. Nothing happens with a torch
// built without CUDA (there is no CUDA tensor to order then).
void use_torch_streams();

// torch.randperm(n, generator=torch.Generator().manual_seed(seed)), as a vector.
std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed);

// torch.utils.data.DistributedSampler for torch::data: same indices for the same
// (n, replicas, rank, shuffle, seed, epoch, drop_last). Call set_epoch(e) before each epoch.
class DistributedSampler : public ::torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  DistributedSampler(size_t size, int num_replicas, int rank, bool shuffle = true, uint64_t seed = 0,
                     bool drop_last = false);
  void set_epoch(int64_t epoch);
  // This rank's indices for the current epoch (what iterating the Python sampler yields).
  std::vector<int64_t> indices() const { return sampler_.indices(); }
  // The rest of an epoch resumed at `cursor` of the order that `epoch_world` ranks began
  // (train::DistributedSampler::indices_from; docs/training.md, "Resuming").
  std::vector<int64_t> indices_from(int64_t cursor, int epoch_world) const {
    return sampler_.indices_from(cursor, epoch_world);
  }
  int64_t longest_share(int64_t cursor, int epoch_world) const { return sampler_.longest_share(cursor, epoch_world); }
  int64_t total_size_for(int world) const { return sampler_.total_size_for(world); }
  int64_t num_samples() const { return sampler_.num_samples(); }

  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(::torch::serialize::OutputArchive& archive) const override;
  void load(::torch::serialize::InputArchive& archive) override;

 private:
  train::DistributedSampler sampler_;
  size_t size_;
  int num_replicas_, rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  std::vector<int64_t> current_;
  size_t cursor_ = 0;
};

// Checkpoints: rank 0 writes model + optimizer + position atomically to <dir>/checkpoint.bin (the
// one before is kept as checkpoint.1.bin).
void save_checkpoint(const std::string& dir, ::torch::nn::Module& module, ::torch::optim::Optimizer& optimizer,
                     const train::TrainingPosition& position);
// Loads the newest complete checkpoint of <dir> into module and optimizer (every rank); nullopt when
// there is none.
std::optional<train::TrainingPosition> load_checkpoint(const std::string& dir, ::torch::nn::Module& module,
                                                       ::torch::optim::Optimizer& optimizer);

// Restarts so far: cohort run's COHORT_RESTART_COUNT (every restart, an elastic job's membership
// changes included), else torchrun's TORCHELASTIC_RESTART_COUNT; 0 on a first start.
int restart_count();
// Automatic resume (docs/training.md): on a restart (restart_count() > 0), loads the newest complete
// checkpoint of `dir` into module and optimizer, on every rank; nullopt on a first start, when `dir`
// is empty, or when it holds no checkpoint yet.
std::optional<train::TrainingPosition> resume_after_restart(const std::string& dir, ::torch::nn::Module& module,
                                                            ::torch::optim::Optimizer& optimizer);

// Which BLAS library the process has mapped (from /proc/self/maps), e.g.
// "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3", or "" when none is mapped yet.
std::string blas_in_use();

}  // namespace cohort::torch
