#pragma once
// Which torch a Python interpreter would import, asked without importing it (`import torch` loads its
// libraries: seconds); used to spell torch.distributed.launch's local rank argument as the installed
// torch's own launch does (`cohort launch`, docs/launcher.md "torch.distributed.launch's line").

#include <optional>
#include <string>

#include "launch/plan.h"

namespace cohort::launch {

// The version torch/version.py of `python`'s torch states ("1.13.0a0", "2.6.0+cpu"). nullopt when that
// Python has no torch, or when the probe cannot run or gives no answer within `timeout_s`; `why` then
// says which (one clause, for --dry-run's source).
std::optional<std::string> installed_torch_version(const std::string& python, double timeout_s, std::string& why);

// --local-rank-arg auto (cohort launch's default): "--local-rank" when the worker's interpreter
// (plan.program_path) has torch 2 or later, whose launch passes that; "--local_rank" otherwise (torch
// 1.x's, also when no torch is found or the program runs directly). Records the reason in
// plan.form.local_rank_arg_source. Does nothing unless the spelling is "auto".
void choose_local_rank_arg(Plan& plan);

}  // namespace cohort::launch
