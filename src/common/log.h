#pragma once
// Logging: one line per message on stderr, "cohort[<who>] <level>: <text>".
// The level comes from COHORT_LOG_LEVEL (error, warn, info, debug; default warn) and is read once.
// <who> is set by the layer that knows it ("rank 3", "launcher", "store") so that interleaved
// output from many processes stays attributable.

#include <fmt/core.h>

#include <string>
#include <string_view>

namespace cohort::log {

enum class Level { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

Level level();
void set_level(Level l);
// Identity printed in every line of this process.
void set_identity(std::string who);
const std::string& identity();
void write(Level l, std::string_view text);

template <typename... Args>
void error(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::kError, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  if (level() >= Level::kWarn) write(Level::kWarn, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  if (level() >= Level::kInfo) write(Level::kInfo, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void debug(fmt::format_string<Args...> f, Args&&... args) {
  if (level() >= Level::kDebug) write(Level::kDebug, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace cohort::log
