// The helpers every `cohort` sub-command shares (tools/command.h).
#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "cohort/error.h"
#include "command.h"
#include "common/strings.h"

namespace cohort::tools {

bool parse_command_line(CLI::App& app, const std::vector<std::string>& args, const std::string& after_help) {
  std::vector<std::string> rest(args.begin() + (args.empty() ? 0 : 1), args.end());
  std::reverse(rest.begin(), rest.end());  // CLI11 takes them last first
  try {
    app.parse(rest);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      fmt::print("{}{}", app.help(), after_help);
      return false;
    }
    throw ConfigError(fmt::format("{} (cohort {} --help lists the flags)", e.what(),
                                  args.empty() ? std::string("") : args[0]));
  }
  return true;
}

std::string job_token(const std::string& token_file) {
  if (token_file.empty()) {
    const char* t = std::getenv("COHORT_JOB_TOKEN");
    return t ? t : "";
  }
  std::ifstream f(token_file);
  if (!f) throw ConfigError(fmt::format("--token-file {}: cannot read the file", token_file));
  std::stringstream ss;
  ss << f.rdbuf();
  std::string token(str::trim(ss.str()));
  if (token.empty()) throw ConfigError(fmt::format("--token-file {}: the file is empty", token_file));
  return token;
}

}  // namespace cohort::tools
