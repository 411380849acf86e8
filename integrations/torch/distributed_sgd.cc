#include "cohort/torch/distributed_sgd.h"

#include <fmt/format.h>

#include "common/log.h"

namespace cohort::torch {

DistributedSGD::DistributedSGD(DistributedDataParallel& ddp, ::torch::optim::SGDOptions options)
    : ::torch::optim::SGD(ddp.parameters(), options), ddp_(ddp) {
  for (const auto& p : ddp.parameters())
    if (p.requires_grad()) synced_.insert(p.unsafeGetTensorImpl());
  // Reasons that hold for good; the options' (why_not_fused) are checked at every step.
  if (ddp.communicator().size() == 1) {
    fixed_reason_ = "one rank";
  } else if (!ddp.parameters().empty() && !ddp.parameters().front().device().is_cpu()) {
    fixed_reason_ = "parameters on a GPU (NCCL reduces the buckets)";
  } else if (!ddp.communicator().one_pass_update()) {
    // Over the transports the fused step would be an allreduce after backward: overlapping it with
    // backward, as DDP does, is worth more.
    fixed_reason_ = "the ranks do not share one host's memory: DDP's allreduce overlaps backward instead";
  } else if (ddp.sync().options().compression != train::WireCompression::kNone) {
    fixed_reason_ = fmt::format("wire compression ({})", train::compression_name(ddp.sync().options().compression));
  }
  // Options that cannot fuse now keep DDP's overlapped averaging (changed later, they are not fused).
  if (fixed_reason_.empty() && why_not_fused().empty()) ddp_.enable_fused_update();
  log::debug("DistributedSGD: {}", fused() ? "fused step" : "not fused: " + why_not_fused());
}

std::string DistributedSGD::why_not_fused() const {
  if (!fixed_reason_.empty()) return fixed_reason_;
  if (param_groups().size() != 1) return fmt::format("{} parameter groups (one set of options fuses)", param_groups().size());
  const auto& o = static_cast<const ::torch::optim::SGDOptions&>(param_groups().front().options());
  if (o.momentum() != 0) return "momentum (its buffers are not sharded yet)";
  if (o.nesterov()) return "nesterov";
  // Added parameters (add_param_group, params().push_back) are not in the DDP's buckets.
  size_t seen = 0;
  for (const auto& p : param_groups().front().params()) {
    if (!p.requires_grad()) continue;
    if (!synced_.count(p.unsafeGetTensorImpl())) return "a parameter that the DDP does not synchronise";
    ++seen;
  }
  if (seen != synced_.size()) return "the optimizer leaves out some of the DDP's parameters";
  return {};
}

::torch::Tensor DistributedSGD::step(LossClosure closure) {
  if (!ddp_.fused_update() || !fused()) {
    // DDP's usual average (a no-op when backward already did it), then torch's step.
    if (ddp_.fused_update()) ddp_.finish_gradient_sync();
    return ::torch::optim::SGD::step(closure);
  }
  ::torch::Tensor loss;
  if (closure) {
    ::torch::AutoGradMode enable_grad(true);
    loss = closure();
  }
  const auto& o = static_cast<const ::torch::optim::SGDOptions&>(param_groups().front().options());
  if (ddp_.step_fused({static_cast<float>(o.lr()), static_cast<float>(o.weight_decay())})) return loss;
  // Nothing to reduce (a backward under no_sync, or gradients averaged already): torch's step on .grad.
  ::torch::optim::SGD::step();
  return loss;
}

}  // namespace cohort::torch
