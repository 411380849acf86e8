#pragma once
// CPU features that __builtin_cpu_supports cannot name with every compiler cohort builds with: clang 14
// (the sanitizer build's compiler) rejects "f16c" there, GCC accepts it. CPUID answers for both.
#include <cpuid.h>

namespace cohort {

// F16C: the half <-> float conversion instructions (CPUID leaf 1, ECX bit 29). Callers also check
// AVX, whose registers they use, with __builtin_cpu_supports("avx"), which includes the OS's support.
inline bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ecx & bit_F16C) != 0;
}

}  // namespace cohort
