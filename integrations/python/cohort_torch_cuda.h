// CUDA tensors in the PyTorch backend (torch 2.x; Debian's torch 1.13 has no CUDA, and check_tensor
// refuses a CUDA tensor there in one line). CUDA tensors go to torch's own NCCL backend, built over the
// same store, or, without NCCL, are staged through host memory (ProcessGroupCohort::route_cuda_call,
// in cohort_torch_cuda.cc). "cpu:cohort,cuda:nccl" is the documented form: torch then sends CUDA tensors
// to NCCL itself.
#pragma once

#include <string>
#include <utility>

#include "cohort_torch_common.h"

namespace cohort_torch {

#if TORCH_VERSION_MAJOR >= 2
// torch's NCCL backend over `store` for CUDA tensors, or null and why CUDA tensors are staged instead.
std::pair<c10::intrusive_ptr<BaseGroup>, std::string> make_cuda_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                                        int rank, int size, int local_size,
                                                                        Millis timeout);
#endif

}  // namespace cohort_torch
