#pragma once
// Helpers shared by the launcher's unit tests (plan, parsers, GPU planning).

#include <string>
#include <utility>
#include <vector>

#include "cohort/error.h"

namespace cohort::launch {

// The ConfigError message `f` throws, or "(no error)".
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

// The value of `k` in a worker environment, or "(unset)".
inline std::string env_value(const std::vector<std::pair<std::string, std::string>>& env, const std::string& k) {
  for (const auto& [name, v] : env)
    if (name == k) return v;
  return "(unset)";
}

}  // namespace cohort::launch
