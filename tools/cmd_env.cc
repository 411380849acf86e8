// `cohort env`: lists every COHORT_* setting with its default and current value.
#include <fmt/core.h>

#include "command.h"
#include "common/env.h"

namespace cohort::tools {
namespace {

int run_env(std::vector<std::string> args) {
  if (args.size() > 1 && (args[1] == "-h" || args[1] == "--help")) {
    fmt::print("usage: cohort env\nLists the COHORT_* environment variables cohort reads, with defaults and current values.\n");
    return 0;
  }
  for (const auto& s : env::registered()) {
    auto v = env::get_raw(s.name);
    fmt::print("{:<28} default {:<10} {}{}\n", s.name, s.default_text.empty() ? "''" : s.default_text, s.doc,
               v ? fmt::format(" (set: {})", *v) : "");
  }
  return 0;
}

Registration reg("env", "list the COHORT_* environment variables and their values", run_env);

}  // namespace
}  // namespace cohort::tools
