#pragma once
// Internal view of the reduction kernels: which families exist, and calling one explicitly.
// Used by the dispatcher (reduce_kernels_simd.cc), the kernel tests and the kernel benchmark.

#include <cstddef>

#include "cohort/types.h"

namespace cohort::kernels {

enum class KernelFamily { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const char* family_name(KernelFamily f);
// Whether this CPU can run the family (the scalar one always can).
bool family_supported(KernelFamily f);
// The family reduce_into/reduce_to use: the best supported one, or COHORT_REDUCE_KERNELS
// (scalar|avx2|avx512) when set and supported. Chosen once per process.
KernelFamily active_family();

// dst[i] = op(a[i], b[i]) with the given family (dst may alias a or b element for element).
void reduce_to_family(KernelFamily f, void* dst, const void* a, const void* b, size_t count, DataType dtype,
                      ReduceOp op);

// data[i] /= divisor with the given family (float types; kAvg's last step).
void finish_average_family(KernelFamily f, void* data, size_t count, DataType dtype, int divisor);

// Reference kernels (reduce_kernels_scalar.cc).
void finish_average_scalar(void* data, size_t count, DataType dtype, int divisor);
void reduce_to_scalar(void* dst, const void* a, const void* b, size_t count, DataType dtype, ReduceOp op);

}  // namespace cohort::kernels
