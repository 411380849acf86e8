#include "cohort/train/sgd.h"

#include "common/vector_clones.h"

namespace cohort::train {

// One clone per vector width (with FMA, like torch's own kernels), picked at load time (GCC's function
// multiversioning): the loop is memory-bound, but a scalar one would not keep up with memory.
COHORT_VECTOR_KERNEL
void sgd_step(float* __restrict params, const float* __restrict grads, size_t count, const SgdStep& step) {
  const float lr = step.lr, wd = step.weight_decay;
  if (wd == 0.0f) {
    for (size_t i = 0; i < count; ++i) params[i] = params[i] + -lr * grads[i];
  } else {
    for (size_t i = 0; i < count; ++i) params[i] = params[i] + -lr * (grads[i] + wd * params[i]);
  }
}

}  // namespace cohort::train
