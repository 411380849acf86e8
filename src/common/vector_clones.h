#pragma once
// COHORT_VECTOR_CLONES: one clone of a function per vector width (AVX-512, AVX2 + FMA, the baseline),
// picked at load time by GCC's function multiversioning. Use: __attribute__((COHORT_VECTOR_CLONES
// optimize("tree-vectorize"))).
//
// The pick happens in an ifunc resolver that the dynamic loader runs before any sanitizer runtime is
// up. ThreadSanitizer instruments the resolver too, so a TSan build would crash at load time: under
// TSan the function has its baseline version only.
#if defined(__SANITIZE_THREAD__)
#define COHORT_VECTOR_CLONES
#else
#define COHORT_VECTOR_CLONES target_clones("arch=skylake-avx512", "arch=haswell", "default"),
#endif
