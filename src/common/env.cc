#include "common/env.h"

#include <cerrno>
#include <cctype>
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
  throw ConfigError(fmt::format("{}={}: expected {}", name, shown_value(name, value), expected));
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

namespace {
// What `cohort run` sets for every worker (docs/launcher.md, "What every worker gets"), the contract
// between the launcher (launch/plan_worker_env.cc) and the worker side (comm/launch_env.cc, gpu/, ps/). Kept
// here, in the registry itself, so that `cohort env` lists them in every binary.
const SettingInfo kProvided[] = {
    {"COHORT_STORE_ADDR", "", "host:port of the job's store (hosted by the head / node 0 launcher)", true},
    {"COHORT_JOB_ID", "", "the job id; the store keys of different jobs never mix", true},
    {"COHORT_JOB_TOKEN", "",
     "the store's authentication token (set it yourself on every node of a per-node job to authenticate it)", true,
     true},
    {"COHORT_RANK", "", "this worker's global rank", true},
    {"COHORT_WORLD_SIZE", "", "the number of workers", true},
    {"COHORT_LOCAL_RANK", "", "this worker's rank on its node", true},
    {"COHORT_LOCAL_WORLD_SIZE", "", "the number of workers on this node", true},
    {"COHORT_NODE_RANK", "", "this node's rank", true},
    {"COHORT_NNODES", "", "the number of nodes", true},
    {"COHORT_RESTART_COUNT", "", "0, then 1, 2, ... after each restart (elastic jobs: the generation)", true},
    {"COHORT_GPUS_PER_NODE", "", "GPU jobs (--gpus-per-node): the GPUs per node", true},
    {"COHORT_LOCAL_GPU", "", "GPU jobs: the device number this rank uses", true},
    // Declared as settings where they are read (trace/recorder.cc), with their own text.
    {"COHORT_FLIGHT_RECORDER_FD", "", "", true},
    {"COHORT_TIMELINE_RANK_FILE", "", "", true},
    {"COHORT_ROLE", "", "parameter-server jobs: worker or server", true},
    {"COHORT_ROLE_INDEX", "", "parameter-server jobs: the index within the role", true},
    {"COHORT_NUM_SERVERS", "", "parameter-server jobs: the number of servers", true},
    {"COHORT_NUM_WORKERS", "", "parameter-server jobs: the number of workers", true},
};
}  // namespace

std::vector<SettingInfo> registered() {
  std::lock_guard<std::mutex> g(registry_mutex());
  std::vector<SettingInfo> all = registry();
  for (const auto& p : kProvided) {
    bool known = false;
    for (auto& s : all) {
      if (s.name != p.name) continue;
      s.provided = true;
      s.secret = s.secret || p.secret;
      known = true;
    }
    if (!known) all.push_back(p);
  }
  return all;
}

bool is_secret(const std::string& name) {
  std::string upper;
  for (char c : name) upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const char* word : {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "PRIVATE_KEY"})
    if (upper.find(word) != std::string::npos) return true;
  for (const auto& s : registered())
    if (s.secret && s.name == name) return true;
  return false;
}

std::string shown_value(const std::string& name, const std::string& value) {
  return is_secret(name) && !value.empty() ? kSecretShown : value;
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

std::string format_seconds(double s) {
  if (s == 0) return "0 s";
  if (s < 1) return fmt::format("{:g} ms", s * 1000);
  if (s >= 3600 && std::fmod(s, 3600) == 0) return fmt::format("{:g} h", s / 3600);
  return fmt::format("{:g} s", s);
}

std::string format_bytes(uint64_t b) {
  static const char* const units[] = {"GiB", "MiB", "KiB"};
  for (int i = 0; i < 3; ++i) {
    const uint64_t unit = uint64_t{1} << (10 * (3 - i));
    if (b >= unit && b % unit == 0) return fmt::format("{} {}", b / unit, units[i]);
  }
  return std::to_string(b);
}

bool parse_bool(const std::string& name, const std::string& value) {
  const char* v = value.c_str();
  if (!strcasecmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes") || !strcasecmp(v, "on")) return true;
  if (!strcasecmp(v, "0") || !strcasecmp(v, "false") || !strcasecmp(v, "no") || !strcasecmp(v, "off")) return false;
  bad(name, value, "a boolean (1/0, true/false, yes/no, on/off)");
}

}  // namespace cohort::env
