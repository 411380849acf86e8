#pragma once
// What the wrappers of a whole model (DistributedDataParallel, FullyShardedDataParallel) take as their
// module: a ModuleHolder (torch::nn::Sequential, a TORCH_MODULE) or a shared_ptr to a module.

#include <utility>

namespace cohort::torch {

// The shared_ptr inside a ModuleHolder (its ptr()), or the shared_ptr itself.
template <typename M>
auto holder_ptr(M module) {
  if constexpr (requires { module.ptr(); }) return module.ptr();
  else return module;
}

}  // namespace cohort::torch
