// cohort_torch: what every file of the PyTorch backend module shares: torch's headers, the base class
// of the backend for this torch, and the module's namespace. Internal to the module (it is built with
// hidden visibility, so nothing in namespace cohort_torch leaves the .so); cohort_torch_module.cc
// describes the design and says which file holds what.
#pragma once

#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include <ATen/ATen.h>

#include <chrono>

namespace py = pybind11;

namespace cohort_torch {

// torch 1.x subclasses c10d::ProcessGroup; torch 2.x subclasses c10d::Backend (registered with
// devices=["cpu", "cuda"]). The two share every method signature used here, so the class body is the
// same; only the base class and the registration call differ (TORCH_VERSION_MAJOR).
#if TORCH_VERSION_MAJOR >= 2
using BaseGroup = c10d::Backend;
#else
using BaseGroup = c10d::ProcessGroup;
#endif

using Millis = std::chrono::milliseconds;

}  // namespace cohort_torch
