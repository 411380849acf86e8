#pragma once
// Settings: the one registry of COHORT_* environment variables.
//
// Each setting is declared once, where it is used, with its type, default and a one-line doc:
//
//   static const auto kTimeout = env::Setting<Seconds>("COHORT_TIMEOUT", 300.0, "deadline of ...");
//   double t = kTimeout.get();
//
// The value is parsed on first get() and cached ("read once"); a bad value throws ConfigError naming
// the variable and what was expected. `cohort env` lists every registered setting, so a variable that
// is read anywhere must be declared here (tests/repo/env_registry.sh checks the sources for that).
//
// Variables that `cohort run` sets for its workers (COHORT_RANK, COHORT_STORE_ADDR, ...) are not
// settings a user chooses; env.cc lists them in the same registry (SettingInfo::provided).

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace cohort::env {

// Raw access (returns nullopt when unset or empty).
std::optional<std::string> get_raw(const std::string& name);

struct SettingInfo {
  std::string name;
  std::string default_text;  // as a user would write it: "300 s", "1 MiB", "auto"; "" = none
  std::string doc;
  bool provided = false;     // set by `cohort run` for every worker, not chosen by the user
  bool secret = false;       // its value is a secret: never printed (see shown_value)
};
// Every setting declared so far (static declarations register at start-up).
std::vector<SettingInfo> registered();
void register_setting(SettingInfo info);

// Whether the value of variable `name` is a secret that cohort never prints (docs/security.md): a
// setting registered as secret (COHORT_JOB_TOKEN), or any variable whose name says it holds one
// (containing TOKEN, SECRET, PASSWORD, PASSWD, CREDENTIAL, API_KEY or PRIVATE_KEY, in any case: a
// user's -x HF_TOKEN is passed on, not shown).
bool is_secret(const std::string& name);
// `value` as cohort prints variable `name`: kSecretShown for a secret's (set, but not shown), `value`
// otherwise.
inline constexpr const char* kSecretShown = "<secret, not shown>";
std::string shown_value(const std::string& name, const std::string& value);

// Parsers shared with the command-line flags. Each throws ConfigError("<name>=<value>: expected ...").
int64_t parse_int(const std::string& name, const std::string& value);
double parse_seconds(const std::string& name, const std::string& value);  // "30", "30s", "500ms", "2m"
uint64_t parse_bytes(const std::string& name, const std::string& value);  // "64", "4K", "16M", "1G"
bool parse_bool(const std::string& name, const std::string& value);       // 1/0 true/false yes/no on/off

// Values as a user would write them (and as the parsers above read them back): "300 s", "200 ms",
// "1 MiB", "64 KiB".
std::string format_seconds(double seconds);
std::string format_bytes(uint64_t bytes);

enum class Kind { kInt, kSeconds, kBytes, kBool, kString };

template <typename T, Kind K>
class Setting {
 public:
  Setting(const char* name, T def, const char* doc) : name_(name), default_(def) {
    register_setting({name, to_text(def), doc});
  }
  const char* name() const { return name_; }
  T get() const {
    std::call_once(once_, [this] { value_ = from(get_raw(name_)); });
    return value_;
  }
  // The value of `raw` under this setting's rules: the default when unset or empty. For environments
  // that are not this process's (the launcher's plan is computed from an injected map).
  T from(const std::optional<std::string>& raw) const {
    if (!raw || raw->empty()) return default_;
    if constexpr (K == Kind::kInt) return static_cast<T>(parse_int(name_, *raw));
    else if constexpr (K == Kind::kSeconds) return parse_seconds(name_, *raw);
    else if constexpr (K == Kind::kBytes) return parse_bytes(name_, *raw);
    else if constexpr (K == Kind::kBool) return parse_bool(name_, *raw);
    else return *raw;
  }

 private:
  static std::string to_text(const T& v) {
    if constexpr (K == Kind::kString) return v;
    else if constexpr (K == Kind::kBool) return v ? "1" : "0";
    else if constexpr (K == Kind::kSeconds) return format_seconds(v);
    else if constexpr (K == Kind::kBytes) return format_bytes(v);
    else return std::to_string(v);
  }
  const char* name_;
  T default_;
  mutable std::once_flag once_;
  mutable T value_{};
};

using IntSetting = Setting<int64_t, Kind::kInt>;
using SecondsSetting = Setting<double, Kind::kSeconds>;
using BytesSetting = Setting<uint64_t, Kind::kBytes>;
using BoolSetting = Setting<bool, Kind::kBool>;
using StringSetting = Setting<std::string, Kind::kString>;

}  // namespace cohort::env
