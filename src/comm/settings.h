#pragma once
// The communicator's COHORT_* settings (registered in src/common/env.h's registry).

#include "cohort/communicator.h"

namespace cohort::comm {

// COHORT_TIMEOUT, COHORT_SLOW_WARNING and COHORT_TRANSPORT, when set, override `options`.
// Bad values throw ConfigError naming the variable.
void apply_env_overrides(CommOptions& options);

// COHORT_TORCH_SHARE_STORAGE (default on): whether the PyTorch backend (integrations/python) may move
// a large allreduce tensor's storage into this communicator's shared memory (allocate_shared).
// Declared in this library, not in the module, so that every cohort binary's registry lists it.
bool torch_share_storage();

// COHORT_DDP_REDUCE_ONE_RANK (default off): a one-rank DDP (src/train/grad_sync.cc) still fills its
// buckets and allreduces them, as PyTorch DDP does, so that one GPU can measure that path. Declared here
// for the same reason.
bool ddp_reduce_one_rank();

}  // namespace cohort::comm
