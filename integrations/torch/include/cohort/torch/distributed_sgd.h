#pragma once
// cohort::torch::DistributedSGD — torch::optim::SGD whose step averages the gradients and updates the
// parameters in one pass (docs/training.md, "The fused SGD step").
//
//   cohort::torch::DistributedDataParallel model(Net(), comm);
//   cohort::torch::DistributedSGD optimizer(model, torch::optim::SGDOptions(0.01));
//   optimizer.zero_grad(); loss = f(model->forward(x), y); loss.backward(); optimizer.step();
//
// With plain DDP + SGD, every step reads and writes the gradients twice after backward: the allreduce
// writes the averages, then SGD reads them and the parameters and writes the parameters. Here the
// parameters live in shared-memory buckets next to the gradients; backward only collects this rank's
// gradients, and step() has each rank reduce a slice of the gradients, apply SGD to that slice of the
// parameters while the reduced values are in cache, and write the result into every rank's parameters
// (Communicator::allreduce_update). The result equals DDP + SGD up to float rounding.
//
// What changes for the loop: between backward() and step(), .grad holds this rank's own gradient, not
// the average (call model.finish_gradient_sync() first to average it, e.g. to clip it: step() then runs
// torch's SGD on the averages); after step(), .grad stays this rank's own until zero_grad().
// Fused only where it can be: more than one rank, parameters on the CPU, no wire compression, and
// options SGD can fuse (momentum 0, one parameter group holding exactly the DDP's parameters); else
// step() is DDP's usual average followed by torch's SGD step, and fused() says so (why_not_fused()).

#include <torch/torch.h>

#include <string>
#include <unordered_set>

#include "cohort/torch/ddp.h"

namespace cohort::torch {

class DistributedSGD : public ::torch::optim::SGD {
 public:
  // Collective (enables the DDP's fused update on every rank).
  DistributedSGD(DistributedDataParallel& ddp, ::torch::optim::SGDOptions options);

  ::torch::Tensor step(LossClosure closure = nullptr) override;

  // Whether step() fuses with the current options (they may change between steps, e.g. the lr).
  bool fused() const { return why_not_fused().empty(); }
  // Why step() does not fuse ("" when it does).
  std::string why_not_fused() const;

 private:
  DistributedDataParallel& ddp_;
  std::string fixed_reason_;  // a reason that cannot change after construction
  // The DDP's synchronised parameters (TensorImpls; fixed at its construction), so that the per-step
  // check of the optimizer's parameters does not rebuild the set.
  std::unordered_set<const void*> synced_;
};

}  // namespace cohort::torch
