#pragma once
// cohort::torch::ShardedOptimizer — ZeRO stages 1 and 2 (Rajbhandari et al., "ZeRO: Memory
// Optimizations Toward Training Trillion Parameter Models") for the libtorch C++ frontend.
//
//   cohort::torch::DistributedDataParallel model(Net(), comm);
//   cohort::torch::ShardedOptimizer optimizer(model, torch::optim::AdamOptions(1e-3), {.stage = 2});
//   optimizer.zero_grad(); loss = f(model->forward(x), y); loss.backward(); optimizer.step();
//
// Data parallelism keeps a whole copy of the optimizer's state on every rank: for Adam in float32,
// 8 bytes per parameter beside the 4 of the parameter and the 4 of its gradient (16 Ψ for Ψ
// parameters). Here each rank keeps the state of 1/N of the parameters only:
//   * the DDP's gradient buckets are reduce-scattered instead of allreduced (still as each bucket
//     fills, overlapping backward): rank r receives the average of chunk r of every bucket;
//   * step() runs torch's own optimizer (SGD, Adam, AdamW) on those chunks alone, so its state
//     exists for them alone;
//   * then an allgather of every bucket's parameters brings each rank's updated chunks to all ranks
//     (the parameters are views of the buckets' parameter memory, so it lands in the model).
// Stage 1 shards the optimizer state (8 Ψ + 8 Ψ/N bytes for fp32 Adam). Stage 2 also frees each
// parameter's gradient as soon as it is in its bucket and a bucket's memory as soon as its
// reduce-scatter ends, keeping only this rank's averaged chunks (4 Ψ + 12 Ψ/N). The results equal
// the unsharded optimizer's on the same global batch up to float rounding (the averaging sums in
// another order); docs/training.md, "The sharded optimizer", has the design and the figures.
//
// What the loop sees: after backward, .grad is not the average (stage 1: this rank's own gradient,
// with its chunks averaged; stage 2: undefined). Clip with clip_grad_norm() (collective), not with
// torch::nn::utils. Change the learning rate with set_lr() (every rank alike). Checkpoints: save()
// and load() (collective) write one file per rank's shard and load at any world size.
//
// The optimizer keeps a reference to the DDP: the DDP must outlive it. CPU and GPU models alike
// (a GPU model's chunks and state live on its GPU; NCCL reduce-scatters and allgathers).

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cohort/torch/ddp.h"
#include "cohort/train/checkpoint.h"

namespace cohort::torch {

struct ShardedOptions {
  // 1: optimizer state sharded; 2: gradients too.
  int stage = 2;
};

class ShardedOptimizer {
 public:
  // Collective over the DDP's communicator: every rank the same optimizer, options and stage (a
  // difference is a MismatchError naming the ranks and both configurations).
  ShardedOptimizer(DistributedDataParallel& ddp, ::torch::optim::SGDOptions options, ShardedOptions sharding = {});
  ShardedOptimizer(DistributedDataParallel& ddp, ::torch::optim::AdamOptions options, ShardedOptions sharding = {});
  ShardedOptimizer(DistributedDataParallel& ddp, ::torch::optim::AdamWOptions options, ShardedOptions sharding = {});
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  void zero_grad();
  // Collective: finishes the gradients' reduce-scatter if backward has not, steps this rank's
  // chunks, and allgathers the parameters.
  void step();
  // Collective: clips the averaged gradients to a total 2-norm of max_norm (what
  // torch::nn::utils::clip_grad_norm_ does to a whole model's gradients) and returns the norm before
  // clipping. Call between backward() and step().
  double clip_grad_norm(double max_norm);

  void set_lr(double lr);
  double lr() const;
  int stage() const { return stage_; }
  const std::string& kind() const { return kind_; }  // "sgd", "adam", "adamw"
  // "adam lr=0.001 betas=(0.9, 0.999) eps=1e-08 weight_decay=0 amsgrad=false, stage 2"
  std::string describe() const;
  // Parameters this rank steps (its chunks, padding included).
  int64_t shard_numel() const;
  // Bytes of optimizer state on this rank (momentum buffers, Adam's moments); 0 before the first step.
  size_t state_bytes() const;
  // Bytes of gradient memory on this rank (the buckets; stage 2: its pool and its chunks).
  size_t gradient_bytes() const;
  // This rank's torch optimizer, over its chunks (its param_groups()[0].options() hold the lr).
  ::torch::optim::Optimizer& shard_optimizer() { return *optimizer_; }

  // Collective checkpoint into `dir` (what cohort::torch::save_checkpoint writes, and beside it
  // <dir>/zero/step-<global_step>/shard-<r>-of-<N>.bin, one per rank's optimizer state). Rank 0
  // writes the model and the position last, after every shard is on disk, so the newest complete
  // checkpoint always has all its shards. Directories of older steps than the two kept checkpoints
  // are removed.
  void save(const std::string& dir, const train::TrainingPosition& position);
  // Collective: loads the newest complete checkpoint of `dir` into the model and this optimizer,
  // whatever world size wrote it (each rank reads the pieces of every shard that overlap its own
  // chunks); nullopt when `dir` holds none. Throws naming the file when a shard is missing or was
  // written by another kind of optimizer.
  std::optional<train::TrainingPosition> load(const std::string& dir);

 private:
  using Factory = std::function<std::unique_ptr<::torch::optim::Optimizer>(std::vector<::torch::Tensor>)>;
  ShardedOptimizer(DistributedDataParallel& ddp, std::string kind, std::string options_text, Factory factory,
                   ShardedOptions sharding);
  void check_same_configuration();
  // The optimizer state's tensors by name, per chunk ("momentum_buffer"; "exp_avg", "exp_avg_sq"
  // and with amsgrad "max_exp_avg_sq"), and the step count (Adam's bias correction).
  std::vector<std::string> state_names() const;
  ::torch::Tensor state_tensor(size_t chunk, const std::string& name) const;
  int64_t state_step() const;
  void set_state(size_t chunk, const std::vector<::torch::Tensor>& tensors, int64_t step);
  void create_state();

  DistributedDataParallel& ddp_;
  std::string kind_;
  std::string options_text_;
  int stage_;
  bool stepped_ = false;  // the first step() has run (it creates the optimizer's state)
  std::vector<::torch::Tensor> chunks_;  // this rank's parameter chunks, one per bucket (.grad: the averages)
  std::unique_ptr<::torch::optim::Optimizer> optimizer_;
};

// Automatic resume (as resume_after_restart for the unsharded optimizers): on a restart, loads the
// newest complete checkpoint of `dir` into the model and the optimizer (every rank).
std::optional<train::TrainingPosition> resume_after_restart(const std::string& dir, ShardedOptimizer& optimizer);

}  // namespace cohort::torch
