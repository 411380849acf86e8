#pragma once
// The step of torch.optim.SGD without momentum, on raw float32 memory: what GradientSync's fused update
// (Communicator::allreduce_update) applies to each slice of the parameters right after reducing its
// gradients, while both are still in cache.

#include <cstddef>

namespace cohort::train {

struct SgdStep {
  float lr = 0;
  float weight_decay = 0;
};

// params[i] -= lr * (grads[i] + weight_decay * params[i]), as torch's SGD computes it (weight decay
// added to the gradient first, then p + (-lr) * d).
void sgd_step(float* params, const float* grads, size_t count, const SgdStep& step);

}  // namespace cohort::train
