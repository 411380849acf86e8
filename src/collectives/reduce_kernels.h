#pragma once
// Element-wise reduction kernels: dst[i] = op(dst[i], src[i]) for every dtype and op.
//
// reduce_into() dispatches to the fastest kernel the CPU supports (chosen once at run time);
// reduce_into_scalar() is the portable reference the fast kernels are tested against.
// float16/bfloat16 are widened to float32, combined, and rounded to nearest even.
// kAvg combines like kSum; finish_average() divides by the number of contributors at the end.

#include <cstddef>

#include "cohort/types.h"

namespace cohort::kernels {

void reduce_into(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op);
void reduce_into_scalar(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op);

// dst[i] = op(a[i], b[i]) (dst may alias a or b).
void reduce_to(void* dst, const void* a, const void* b, size_t count, DataType dtype, ReduceOp op);

// Divides every element by `divisor` (for kAvg; float types only).
void finish_average(void* data, size_t count, DataType dtype, int divisor);

// Name of the kernel family in use ("avx512", "avx2", "scalar"), for logs and benchmarks.
const char* kernel_family();

}  // namespace cohort::kernels
