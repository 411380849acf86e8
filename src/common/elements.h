#pragma once
// Element access by data type, through double, a reduction computed in double, and the inputs the
// checked collectives use: what compares a collective's result with a reference (the test suites,
// `cohort bench --check`). One switch per element: not for hot paths.

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

// Element i on rank `rank` of a checked collective: small integers, so that every dtype and op has an
// exact result for the world sizes a test or bench uses (sums of up to ~20 ranks stay inside int8;
// a product has at most one factor of 3 and one factor of 2 per four ranks, and signs).
double check_input(int rank, size_t i, DataType t, ReduceOp op);
// The exact result at element i of `op` over ranks 0..world-1 of check_input (int8/uint8 products wrap
// as the element type does; kAvg divides in double).
double check_expected(int world, size_t i, DataType t, ReduceOp op);
// How far a result may be from check_expected: the rounding of the 16-bit floats and of kAvg.
double check_tolerance(DataType t, double expected);

}  // namespace cohort
