#pragma once
// Element access by data type, through double, and a reduction computed in double: what the checks
// that compare a collective's result with a reference need (the test suites, `cohort bench --check`).
// One switch per element: not for hot paths.

#include <algorithm>
#include <cstddef>

#include "cohort/types.h"

namespace cohort {

// Writes v into element i of a buffer of type t (a plain cast; float16/bfloat16 round to nearest even).
void store_element(void* buf, size_t i, DataType t, double v);
// Element i of a buffer of type t, widened to double.
double load_element(const void* buf, size_t i, DataType t);

// op folded over value(0), ..., value(world - 1) in rank order, in double; kAvg divides by world.
template <class Value>
double fold_reference(int world, ReduceOp op, Value value) {
  double acc = value(0);
  for (int r = 1; r < world; ++r) {
    double v = value(r);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc += v; break;
      case ReduceOp::kProd: acc *= v; break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
    }
  }
  return op == ReduceOp::kAvg ? acc / world : acc;
}

}  // namespace cohort
