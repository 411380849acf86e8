#pragma once
// Where a layer loads a C library at run time (dlopen/dlsym) with its own declarations instead of the
// library's headers, its abi_check file compares them with the real ones when those headers are
// installed (comm/pmix_abi_check.cc for PMIx, gpu/abi_check.cc for CUDA and NCCL). This is their
// check of a function: the same parameter list as the real prototype, parameter by parameter and the
// result, by size (handles may be void*, enums int). A mismatch is a build error there.
//   COHORT_SAME_ARITY(PMIx_Init, Api{}.Init);

namespace cohort::abi {

template <typename Real, typename Ours>
constexpr bool same_arity = false;
template <typename R1, typename... A1, typename R2, typename... A2>
constexpr bool same_arity<R1 (*)(A1...), R2 (*)(A2...)> =
    sizeof...(A1) == sizeof...(A2) && ((sizeof(A1) == sizeof(A2)) && ...) && sizeof(R1) == sizeof(R2);

}  // namespace cohort::abi

#define COHORT_SAME_ARITY(real, ours) \
  static_assert(::cohort::abi::same_arity<decltype(&real), decltype(ours)>, #real)
