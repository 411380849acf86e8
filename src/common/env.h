#pragma once
// Settings: the one registry of COHORT_* environment variables.
//
// Each setting is declared once, where it is used, with its type, default and a one-line doc:
//
//   static const auto kTimeout = env::Setting<Seconds>("COHORT_TIMEOUT", 300.0, "deadline of ...");
//   double t = kTimeout.get();
//
// The value is parsed on first get() and cached ("read once"); a bad value throws ConfigError naming
// the variable and what was expected. `cohort run --help-env` lists every registered setting, and the
// value chosen is logged at debug level.

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
  std::string default_text;
  std::string doc;
};
// Every setting declared so far (static declarations register at start-up).
std::vector<SettingInfo> registered();
void register_setting(SettingInfo info);

// Parsers shared with the command-line flags. Each throws ConfigError("<name>=<value>: expected ...").
int64_t parse_int(const std::string& name, const std::string& value);
double parse_seconds(const std::string& name, const std::string& value);  // "30", "30s", "500ms", "2m"
uint64_t parse_bytes(const std::string& name, const std::string& value);  // "64", "4K", "16M", "1G"
bool parse_bool(const std::string& name, const std::string& value);       // 1/0 true/false yes/no on/off

enum class Kind { kInt, kSeconds, kBytes, kBool, kString };

template <typename T, Kind K>
class Setting {
 public:
  Setting(const char* name, T def, const char* doc) : name_(name), default_(def) {
    register_setting({name, to_text(def), doc});
  }
  const char* name() const { return name_; }
  T get() const {
    std::call_once(once_, [this] { value_ = parse(); });
    return value_;
  }

 private:
  static std::string to_text(const T& v) {
    if constexpr (K == Kind::kString) return v;
    else if constexpr (K == Kind::kBool) return v ? "1" : "0";
    else return std::to_string(v);
  }
  T parse() const {
    auto raw = get_raw(name_);
    if (!raw) return default_;
    if constexpr (K == Kind::kInt) return static_cast<T>(parse_int(name_, *raw));
    else if constexpr (K == Kind::kSeconds) return parse_seconds(name_, *raw);
    else if constexpr (K == Kind::kBytes) return parse_bytes(name_, *raw);
    else if constexpr (K == Kind::kBool) return parse_bool(name_, *raw);
    else return *raw;
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
