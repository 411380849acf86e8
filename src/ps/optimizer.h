#pragma once
// The parameter-server optimizers' update rules (TableConfig::optimizer: SGD, Adagrad, lazy Adam), one
// row at a time. Inline: TableShard::apply (table.cc) runs it for every row it updates, between the
// row's lock and unlock, and it must compile into that loop as it did beside it.

#include <cmath>
#include <cstdint>

#include "cohort/ps.h"
#include "common/vector_clones.h"

namespace cohort::ps {

// One row's optimizer step. Vectorized (restrict pointers, and the vectorizer asked for: at -O2 GCC
// only vectorizes loops whose trip count is a multiple of the vector width); a scalar loop costs
// about as much per row as the row's cache misses. The baseline ISA only (no FMA contraction), so
// every machine computes the same bits.
inline COHORT_VECTORIZE void optimizer_step(const TableConfig& c, float* __restrict w, float* __restrict st,
                                     const float* __restrict g) {
  const uint32_t d = c.dim;
  const float lr = c.lr, eps = c.eps, beta1 = c.beta1, beta2 = c.beta2;
  switch (c.optimizer) {
    case Optimizer::kSgd:
      for (uint32_t j = 0; j < d; ++j) w[j] -= lr * g[j];
      break;
    case Optimizer::kAdagrad:
      for (uint32_t j = 0; j < d; ++j) {
        st[j] += g[j] * g[j];
        w[j] -= lr * g[j] / (std::sqrt(st[j]) + eps);
      }
      break;
    case Optimizer::kAdam: {
      // Lazy Adam (as TensorFlow's for sparse rows): a row's moments and bias correction advance
      // only when the row gets a gradient; st[2d] counts its steps.
      float* m = st;
      float* v = st + d;
      float t = (st[2 * d] += 1.0f);
      const float c1 = 1.0f - std::pow(beta1, t), c2 = 1.0f - std::pow(beta2, t);
      for (uint32_t j = 0; j < d; ++j) {
        m[j] = beta1 * m[j] + (1 - beta1) * g[j];
        v[j] = beta2 * v[j] + (1 - beta2) * g[j] * g[j];
        w[j] -= lr * (m[j] / c1) / (std::sqrt(v[j] / c2) + eps);
      }
      break;
    }
  }
}

}  // namespace cohort::ps
