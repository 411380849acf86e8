#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <strings.h>

#include "common/console.h"

namespace cohort::log {
namespace {

Level parse_level(const char* s) {
  if (s == nullptr || *s == '\0') return Level::kWarn;
  if (strcasecmp(s, "error") == 0) return Level::kError;
  if (strcasecmp(s, "warn") == 0 || strcasecmp(s, "warning") == 0) return Level::kWarn;
  if (strcasecmp(s, "info") == 0) return Level::kInfo;
  if (strcasecmp(s, "debug") == 0 || strcasecmp(s, "trace") == 0) return Level::kDebug;
  return Level::kWarn;
}

std::atomic<int>& level_storage() {
  static std::atomic<int> l{static_cast<int>(parse_level(std::getenv("COHORT_LOG_LEVEL")))};
  return l;
}

std::mutex& identity_mutex() {
  static std::mutex m;
  return m;
}

std::string& identity_storage() {
  static std::string who = "pid " + std::to_string(::getpid());
  return who;
}

const char* level_name(Level l) {
  switch (l) {
    case Level::kError: return "error";
    case Level::kWarn: return "warning";
    case Level::kInfo: return "info";
    case Level::kDebug: return "debug";
  }
  return "?";
}

}  // namespace

Level level() { return static_cast<Level>(level_storage().load(std::memory_order_relaxed)); }
void set_level(Level l) { level_storage().store(static_cast<int>(l)); }

void set_identity(std::string who) {
  std::lock_guard<std::mutex> g(identity_mutex());
  identity_storage() = std::move(who);
}

const std::string& identity() { return identity_storage(); }

void write(Level l, std::string_view text) {
  std::string line;
  {
    std::lock_guard<std::mutex> g(identity_mutex());
    line = fmt::format("cohort[{}] {}: {}\n", identity_storage(), level_name(l), text);
  }
  // One write(2) per line so lines from many threads and processes do not interleave; through the
  // console so that a table redrawn in place on the terminal does not erase it (common/console.h).
  console::write(STDERR_FILENO, line);
}

}  // namespace cohort::log
