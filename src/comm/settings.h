#pragma once
// The communicator's COHORT_* settings (registered in src/common/env.h's registry).

#include "cohort/communicator.h"

namespace cohort::comm {

// COHORT_TIMEOUT, COHORT_SLOW_WARNING and COHORT_TRANSPORT, when set, override `options`.
// Bad values throw ConfigError naming the variable.
void apply_env_overrides(CommOptions& options);

}  // namespace cohort::comm
