#include "comm/settings.h"

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/env.h"

namespace cohort::comm {
namespace {
const env::SecondsSetting kTimeout("COHORT_TIMEOUT", 300.0,
                                   "deadline of one collective operation and of building a communicator");
const env::SecondsSetting kSlowWarning("COHORT_SLOW_WARNING", 5.0,
                                       "after this long, a waiting operation (or a communicator being built) logs "
                                       "which ranks it waits for (then again at a doubling interval)");
const env::StringSetting kTransport("COHORT_TRANSPORT", "auto",
                                    "transport between ranks: auto (shm on one host, else tcp), tcp or shm");
const env::BoolSetting kDdpReduceOneRank(
    "COHORT_DDP_REDUCE_ONE_RANK", false,
    "one rank goes through DDP's buckets and their allreduces as N ranks would (PyTorch DDP does), for measuring "
    "the communication path on one GPU; otherwise one rank skips them (its average is its own gradient)");
const env::BoolSetting kTorchShareStorage(
    "COHORT_TORCH_SHARE_STORAGE", true,
    "the PyTorch backend moves the storage of tensors it allreduces often (256 KiB to 64 MiB) into shared memory, "
    "so that ranks on one host reduce in place (0: off)");

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}
}  // namespace

void apply_env_overrides(CommOptions& options) {
  if (env::get_raw(kTimeout.name())) {
    double t = kTimeout.get();
    if (t <= 0) throw ConfigError(fmt::format("COHORT_TIMEOUT={}: expected a positive duration", t));
    options.timeout = to_ms(t);
    options.timeout_source = "COHORT_TIMEOUT";
  }
  if (env::get_raw(kSlowWarning.name())) {
    double t = kSlowWarning.get();
    if (t <= 0) throw ConfigError(fmt::format("COHORT_SLOW_WARNING={}: expected a positive duration", t));
    options.slow_warning = to_ms(t);
  }
  if (env::get_raw(kTransport.name())) options.transport = kTransport.get();
  if (options.timeout.count() <= 0) throw InvalidArgument("CommOptions.timeout must be positive");
  if (options.slow_warning.count() <= 0) throw InvalidArgument("CommOptions.slow_warning must be positive");
}

bool torch_share_storage() { return kTorchShareStorage.get(); }

bool ddp_reduce_one_rank() { return kDdpReduceOneRank.get(); }

}  // namespace cohort::comm
