// `cohort env`: lists every COHORT_* variable cohort reads, from the registry that reads them
// (src/common/env.h): first the settings a user may choose, with their defaults and current values,
// then the variables `cohort run` sets for every worker.
#include <algorithm>

#include <fmt/core.h>

#include "command.h"
#include "common/env.h"

namespace cohort::tools {
namespace {

void print_group(const std::vector<env::SettingInfo>& all, bool provided) {
  std::vector<env::SettingInfo> group;
  for (const auto& s : all)
    if (s.provided == provided) group.push_back(s);
  std::sort(group.begin(), group.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (const auto& s : group) {
    auto v = env::get_raw(s.name);
    // A secret's value (the store's token) is never printed: `cohort env` runs inside workers and in CI
    // logs, where it would hand the job's store to whoever reads them.
    std::string now = v ? fmt::format(" [set here: {}]", env::shown_value(s.name, *v)) : "";
    if (provided)
      fmt::print("  {:<30} {}{}\n", s.name, s.doc, now);
    else
      fmt::print("  {:<30} {:<12} {}{}\n", s.name, s.default_text.empty() ? "(none)" : s.default_text, s.doc, now);
  }
}

int run_env(std::vector<std::string> args) {
  if (args.size() > 1 && (args[1] == "-h" || args[1] == "--help")) {
    fmt::print(
        "usage: cohort env [--names]\n"
        "Lists the COHORT_* environment variables cohort reads: the settings you may choose (default, meaning,\n"
        "and the value set in this environment; a secret's, such as COHORT_JOB_TOKEN's, is not shown), then the\n"
        "ones `cohort run` sets for every worker.\n"
        "Durations are written as 30, 30s, 500ms or 2m; sizes as 4096, 64K, 16M or 1G; booleans as 1/0.\n"
        "--names: only the names, one per line.\n");
    return 0;
  }
  const auto all = env::registered();
  if (args.size() > 1 && args[1] == "--names") {
    std::vector<std::string> names;
    for (const auto& s : all) names.push_back(s.name);
    std::sort(names.begin(), names.end());
    for (const auto& n : names) fmt::print("{}\n", n);
    return 0;
  }
  if (args.size() > 1) {
    fmt::print(stderr, "cohort env: unexpected argument '{}' (usage: cohort env [--names])\n", args[1]);
    return 2;
  }
  fmt::print("Settings (environment variables you may set; every process of a job reads its own):\n");
  fmt::print("  {:<30} {:<12} {}\n", "variable", "default", "meaning");
  print_group(all, false);
  fmt::print("\nSet by `cohort run` for every worker (set them yourself only when starting workers without it):\n");
  print_group(all, true);
  return 0;
}

Registration reg_env("env", "list the COHORT_* environment variables and their values", run_env);

}  // namespace
}  // namespace cohort::tools
