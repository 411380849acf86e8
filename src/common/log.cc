#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <strings.h>

#include "common/console.h"
#include "common/env.h"

namespace cohort::log {
namespace {

constexpr const char* kLevelName = "COHORT_LOG_LEVEL";
// Declared for the registry (`cohort env`). The level itself is read with get_raw at first use, not
// through this object: a static initialiser elsewhere may log before this one has run.
const env::StringSetting kLevel(kLevelName, "warn", "what cohort logs on stderr: error, warn, info or debug");

// nullopt: not a level name.
std::optional<Level> parse_level(const std::string& s) {
  if (strcasecmp(s.c_str(), "error") == 0) return Level::kError;
  if (strcasecmp(s.c_str(), "warn") == 0 || strcasecmp(s.c_str(), "warning") == 0) return Level::kWarn;
  if (strcasecmp(s.c_str(), "info") == 0) return Level::kInfo;
  if (strcasecmp(s.c_str(), "debug") == 0 || strcasecmp(s.c_str(), "trace") == 0) return Level::kDebug;
  return std::nullopt;
}

void write_line(const std::string& line);

std::atomic<int>& level_storage() {
  static std::atomic<int> l{[] {
    auto raw = env::get_raw(kLevelName);
    if (!raw) return static_cast<int>(Level::kWarn);
    auto parsed = parse_level(*raw);
    // A typo must not silence warnings, nor stop the program from logging at all: say so once, go on.
    if (!parsed)
      write_line(fmt::format("cohort[pid {}] warning: {}={}: expected error, warn, info or debug; logging at warn\n",
                             ::getpid(), kLevelName, *raw));
    return static_cast<int>(parsed.value_or(Level::kWarn));
  }()};
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
  write_line(line);
}

namespace {
void write_line(const std::string& line) {
  // One write(2) per line so lines from many threads and processes do not interleave; through the
  // console so that a table redrawn in place on the terminal does not erase it (common/console.h).
  console::write(STDERR_FILENO, line);
}
}  // namespace

}  // namespace cohort::log
