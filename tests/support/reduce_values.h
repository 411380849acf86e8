#pragma once
// What the communicator-level collective tests (tests/comm, tests/transport) check with: every dtype
// and op, and common/elements.h's inputs and references (the ones `cohort bench --check` uses too).

#include <cstddef>
#include <cstdint>

#include "cohort/types.h"
#include "common/elements.h"

namespace cohort::test {

inline constexpr DataType kAllTypes[] = {DataType::kInt8,    DataType::kUInt8,    DataType::kInt32,   DataType::kInt64,
                                         DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64};
inline constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};

// The inputs, references and tolerances of common/elements.h, under the tests' names.
inline double input_for(int r, size_t i, DataType t, ReduceOp op) { return check_input(r, i, t, op); }
inline double reference(int world, size_t i, DataType t, ReduceOp op) { return check_expected(world, i, t, op); }
inline double tolerance(DataType t, double expected) { return check_tolerance(t, expected); }

}  // namespace cohort::test
