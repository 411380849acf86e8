#pragma once
// COHORT_VECTOR_KERNEL: put before a loop kernel's definition. One clone of the function per vector
// width (AVX-512, AVX2 + FMA, the baseline), picked at load time by function multiversioning, each
// with the loop vectorizer asked for (GCC vectorizes at -O2 only loops whose trip count is a multiple
// of the vector width unless asked).
// COHORT_VECTORIZE: the vectorizer asked for, on the baseline ISA only.
//
// The pick happens in an ifunc resolver that the dynamic loader runs before any sanitizer runtime is
// up. ThreadSanitizer instruments the resolver too, so a TSan build would crash at load time: under
// TSan the function has its baseline version only. Clang (the ASan + UBSan build's compiler) has
// target_clones but no optimize attribute: its vectorizer needs no asking at -O2.
#if defined(__clang__)
#define COHORT_VECTORIZE
#if __has_feature(thread_sanitizer)
#define COHORT_VECTOR_KERNEL
#else
#define COHORT_VECTOR_KERNEL __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#endif
#else
#define COHORT_VECTORIZE __attribute__((optimize("tree-vectorize")))
#if defined(__SANITIZE_THREAD__)
#define COHORT_VECTOR_KERNEL COHORT_VECTORIZE
#else
#define COHORT_VECTOR_KERNEL \
  __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default"), optimize("tree-vectorize")))
#endif
#endif
