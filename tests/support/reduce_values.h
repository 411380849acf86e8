#pragma once
// Inputs and expected results for the communicator-level collective tests (tests/comm, tests/transport):
// small integers on every rank, so that every dtype and op has an exact reference (products stay
// small; int8/uint8 products wrap as the element type does), and the tolerance each dtype allows.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cohort/types.h"
#include "common/elements.h"

namespace cohort::test {

inline constexpr DataType kAllTypes[] = {DataType::kInt8,    DataType::kUInt8,    DataType::kInt32,   DataType::kInt64,
                                         DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64};
inline constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};

// Element i on rank r.
inline double input_value(int r, size_t i, ReduceOp op) {
  if (op == ReduceOp::kProd) return double(((size_t(r) + i) % 3) + 1) * (((size_t(r) + 2 * i) % 5 == 0) ? -1 : 1);
  return double(int((size_t(r) * 7 + i * 3) % 11) - 5);
}
// The same, made non-negative for unsigned types.
inline double input_for(int r, size_t i, DataType t, ReduceOp op) {
  double v = input_value(r, i, op);
  return t == DataType::kUInt8 ? std::fabs(v) : v;
}
// The expected result at element i of a reduction over `world` ranks.
inline double reference(int world, size_t i, DataType t, ReduceOp op) {
  double acc = fold_reference(world, op, [&](int r) { return input_for(r, i, t, op); });
  if (t == DataType::kUInt8 && op == ReduceOp::kProd) acc = double(uint8_t(int64_t(acc)));
  if (t == DataType::kInt8 && op == ReduceOp::kProd) acc = double(int8_t(int64_t(acc)));
  return acc;
}
inline double tolerance(DataType t, double expected) {
  if (t == DataType::kFloat16) return 2e-3 * std::max(1.0, std::fabs(expected)) + 1e-3;
  if (t == DataType::kBFloat16) return 1e-2 * std::max(1.0, std::fabs(expected)) + 1e-2;
  if (t == DataType::kFloat32) return 1e-5 * std::max(1.0, std::fabs(expected));
  return 1e-9;
}

}  // namespace cohort::test
