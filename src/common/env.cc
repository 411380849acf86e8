#include "common/env.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <strings.h>

#include <fmt/core.h>

#include "cohort/error.h"

namespace cohort::env {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<SettingInfo>& registry() {
  static std::vector<SettingInfo> r;
  return r;
}

[[noreturn]] void bad(const std::string& name, const std::string& value, const char* expected) {
  throw ConfigError(fmt::format("{}={}: expected {}", name, value, expected));
}

// Splits "123.5K" into number and suffix.
bool split_number(const std::string& s, double* number, std::string* suffix) {
  const char* begin = s.c_str();
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(begin, &end);
  if (end == begin || errno != 0 || !std::isfinite(v)) return false;
  *number = v;
  *suffix = std::string(end);
  while (!suffix->empty() && suffix->front() == ' ') suffix->erase(suffix->begin());
  return true;
}

}  // namespace

std::optional<std::string> get_raw(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::vector<SettingInfo> registered() {
  std::lock_guard<std::mutex> g(registry_mutex());
  return registry();
}

void register_setting(SettingInfo info) {
  std::lock_guard<std::mutex> g(registry_mutex());
  for (auto& s : registry()) {
    if (s.name == info.name) return;
  }
  registry().push_back(std::move(info));
}

int64_t parse_int(const std::string& name, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno != 0) bad(name, value, "an integer");
  return v;
}

double parse_seconds(const std::string& name, const std::string& value) {
  double v = 0;
  std::string suffix;
  if (!split_number(value, &v, &suffix) || v < 0) bad(name, value, "a duration such as 30, 30s, 500ms or 2m");
  if (suffix.empty() || suffix == "s") return v;
  if (suffix == "ms") return v / 1000.0;
  if (suffix == "us") return v / 1e6;
  if (suffix == "m" || suffix == "min") return v * 60.0;
  if (suffix == "h") return v * 3600.0;
  bad(name, value, "a duration such as 30, 30s, 500ms or 2m");
}

uint64_t parse_bytes(const std::string& name, const std::string& value) {
  double v = 0;
  std::string suffix;
  if (!split_number(value, &v, &suffix) || v < 0) bad(name, value, "a size such as 4096, 64K, 16M or 1G");
  double mult = 1;
  if (suffix.empty() || suffix == "B" || suffix == "b") mult = 1;
  else if (suffix == "K" || suffix == "k" || suffix == "KB" || suffix == "KiB") mult = 1024.0;
  else if (suffix == "M" || suffix == "m" || suffix == "MB" || suffix == "MiB") mult = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "g" || suffix == "GB" || suffix == "GiB") mult = 1024.0 * 1024 * 1024;
  else bad(name, value, "a size such as 4096, 64K, 16M or 1G");
  return static_cast<uint64_t>(v * mult);
}

bool parse_bool(const std::string& name, const std::string& value) {
  const char* v = value.c_str();
  if (!strcasecmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes") || !strcasecmp(v, "on")) return true;
  if (!strcasecmp(v, "0") || !strcasecmp(v, "false") || !strcasecmp(v, "no") || !strcasecmp(v, "off")) return false;
  bad(name, value, "a boolean (1/0, true/false, yes/no, on/off)");
}

}  // namespace cohort::env
