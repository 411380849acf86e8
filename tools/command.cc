// The helpers every `cohort` sub-command shares (tools/command.h).
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/core.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "cohort/error.h"
#include "command.h"
#include "common/strings.h"

namespace cohort::tools {

namespace {

// Optimal string alignment distance: insertions, deletions, substitutions and swaps of neighbours
// ("pre" for "per") each count one.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// Every spelling of the app's options: "--nproc-per-node", "--nproc_per_node", "-n", ...
std::vector<std::string> spellings(const CLI::Option& opt) {
  std::vector<std::string> out;
  for (const auto& l : opt.get_lnames()) out.push_back("--" + l);
  for (const auto& s : opt.get_snames()) out.push_back("-" + s);
  return out;
}
bool takes_value(const CLI::Option& opt) { return opt.get_expected_max() > 0 && opt.get_type_size_max() > 0; }
std::vector<std::string> all_spellings(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::Option* opt : app.get_options())
    for (auto& s : spellings(*opt)) out.push_back(std::move(s));
  return out;
}

// Where the user gave option `opt`: "SPELLING VALUE" or "SPELLING=VALUE" for each occurrence (CLI11
// names an option by its long name whatever was typed).
struct Given {
  std::string spelling;  // as typed ("-n")
  std::vector<std::string> uses;  // "-n 2", "-n=3"
};
Given given(const CLI::Option& opt, const std::vector<std::string>& args) {
  Given g;
  auto names = spellings(opt);
  for (size_t i = 1; i < args.size(); ++i) {
    for (const auto& name : names) {
      if (args[i] == name) {
        g.uses.push_back(takes_value(opt) && i + 1 < args.size() ? name + " " + args[i + 1] : name);
      } else if (args[i].rfind(name + "=", 0) == 0) {
        g.uses.push_back(args[i]);
      } else {
        continue;
      }
      if (g.spelling.empty()) g.spelling = name;
      break;
    }
  }
  if (g.spelling.empty()) g.spelling = names.empty() ? opt.get_name() : names.front();
  return g;
}

std::string expected_value(const CLI::Option& opt) {
  std::string type = opt.get_type_name();
  if (type == "INT") return "a whole number";
  if (type == "UINT") return "a whole number >= 0";
  if (type == "FLOAT") return "a number";
  return "a value";
}

const CLI::Option* option_named(const CLI::App& app, const std::string& name) {
  for (const CLI::Option* opt : app.get_options())
    if (opt->get_name() == name || opt->check_name(name)) return opt;
  return nullptr;
}

// CLI11's message (Error.hpp of CLI11 2.x) as one line naming the flag as typed and what was expected.
std::string explain(const CLI::ParseError& e, const CLI::App& app, const std::vector<std::string>& args) {
  const std::string what = e.what();
  // By type: CLI11 names some errors after the app (ExtrasError), so get_name() cannot tell them apart.
  const bool extras = dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr;
  const bool conversion = dynamic_cast<const CLI::ConversionError*>(&e) != nullptr;
  const bool required = dynamic_cast<const CLI::RequiredError*>(&e) != nullptr;
  const bool mismatch = dynamic_cast<const CLI::ArgumentMismatch*>(&e) != nullptr;
  if (extras) {
    // The arguments no option took: flags that are none of the app's, or words where none belong.
    std::vector<std::string> unknown;
    const auto known = all_spellings(app);
    for (size_t i = 1; i < args.size(); ++i) {
      const std::string& a = args[i];
      if (a.size() < 2 || a[0] != '-') continue;
      std::string name = a.substr(0, a.find('='));
      if (std::find(known.begin(), known.end(), name) == known.end()) {
        unknown.push_back(a);
      } else if (a.find('=') == std::string::npos) {
        const CLI::Option* opt = option_named(app, name);
        if (opt && takes_value(*opt)) ++i;  // its value
      }
    }
    if (unknown.empty()) {
      // Not a flag: words the command does not take ("The following argument was not expected: x").
      auto colon = what.find(": ");
      if (colon == std::string::npos) return what;
      auto words = str::split(what.substr(colon + 2), ' ');
      std::reverse(words.begin(), words.end());  // CLI11 lists them as it took them: last first
      return fmt::format("unexpected argument{}: {} (this command takes no such words)", words.size() > 1 ? "s" : "",
                         str::join(words, " "));
    }
    std::vector<std::string> named;
    for (const auto& a : unknown) {
      std::string flag = a.substr(0, a.find('='));
      std::string guess = closest_match(flag, known);
      named.push_back(flag + (guess.empty() ? "" : " (did you mean " + guess + "?)"));
    }
    return fmt::format("unknown flag{} {}", named.size() > 1 ? "s" : "", str::join(named, ", "));
  }
  // "NAME: ..." (ArgumentMismatch), "Could not convert: NAME = VALUE", "NAME is required".
  if (conversion && what.rfind("Could not convert: ", 0) == 0) {
    std::string rest = what.substr(19);
    auto eq = rest.find(" = ");
    if (eq != std::string::npos) {
      if (const CLI::Option* opt = option_named(app, rest.substr(0, eq))) {
        std::string value = rest.substr(eq + 3);
        Given g = given(*opt, args);
        if (!takes_value(*opt)) return fmt::format("{} is a flag: it takes no value, or true/false (got '{}')", g.spelling, value);
        return fmt::format("{} {}: expected {}", g.spelling, value, expected_value(*opt));
      }
    }
    return what;
  }
  if (required && what.size() > 12 && what.ends_with(" is required")) {
    if (const CLI::Option* opt = option_named(app, what.substr(0, what.size() - 12)))
      return fmt::format("{} is required: {}", spellings(*opt).empty() ? opt->get_name() : spellings(*opt).front(),
                         opt->get_description());
    return what;
  }
  auto colon = what.find(": ");
  const CLI::Option* opt = colon == std::string::npos ? nullptr : option_named(app, what.substr(0, colon));
  if (!opt) return what;
  Given g = given(*opt, args);
  std::string detail = what.substr(colon + 2);
  if (mismatch && detail.rfind("At Most", 0) == 0)
    return fmt::format("{} given {} ({}); give it once", g.spelling,
                       g.uses.size() == 2 ? std::string("twice") : fmt::format("{} times", g.uses.size()),
                       str::join(g.uses, ", "));
  if (mismatch && (detail.find("missing") != std::string::npos || detail.rfind("At least", 0) == 0))
    return fmt::format("{} needs {} after it: {}", g.spelling, expected_value(*opt), opt->get_description());
  if (conversion && detail.find("too many inputs for a flag") != std::string::npos)
    return fmt::format("{} is a flag and takes no value", g.spelling);
  return fmt::format("{}: {}", g.spelling, detail);
}

}  // namespace

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  auto plain = [](std::string s) {
    std::replace(s.begin(), s.end(), '_', '-');
    return s;
  };
  const std::string w = plain(word);
  if (w.find_first_not_of('-') == std::string::npos || w.size() - w.find_first_not_of('-') < 3) return "";
  // A long flag cut short ("--nproc" for --nproc-per-node) is close when it begins only one candidate.
  std::set<std::string> extensions;
  for (const auto& c : candidates)
    if (std::string p = plain(c); w.rfind("--", 0) == 0 && p.size() > w.size() && p.rfind(w, 0) == 0) extensions.insert(p);
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& c : candidates) {
    std::string p = plain(c);
    size_t d = extensions.size() == 1 && extensions.count(p) ? 1 : edit_distance(w, p);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  // Close: a few edits for a long word, and fewer than either word has letters ("-mca" is not "-m").
  auto letters = [](const std::string& s) { return s.size() - std::min(s.size(), s.find_first_not_of('-')); };
  if (best.empty() || best_d >= std::min(letters(w), letters(best))) return "";
  return best_d <= std::max<size_t>(2, letters(w) / 3) ? best : "";
}

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
    throw ConfigError(fmt::format("{} (cohort {} --help lists the flags)", explain(e, app, args),
                                  args.empty() ? std::string("") : args[0]));
  }
  return true;
}

std::string job_token(const std::string& token_file) {
  if (token_file.empty()) {
    const char* t = std::getenv("COHORT_JOB_TOKEN");
    return t ? t : "";
  }
  // A token others can read is no secret: the file must be its owner's alone, as ssh requires of a key.
  struct stat st {};
  if (::stat(token_file.c_str(), &st) != 0)
    throw ConfigError(fmt::format("--token-file {}: {}", token_file, std::strerror(errno)));
  if ((st.st_mode & 077) != 0 || st.st_uid != ::geteuid())
    throw ConfigError(fmt::format("--token-file {}: mode {:04o}, owner uid {}: the job token must be readable by its "
                                  "owner only (this user, uid {}): chmod 600 {}",
                                  token_file, st.st_mode & 07777, st.st_uid, ::geteuid(), token_file));
  std::ifstream f(token_file);
  if (!f) throw ConfigError(fmt::format("--token-file {}: cannot read the file", token_file));
  std::stringstream ss;
  ss << f.rdbuf();
  std::string token(str::trim(ss.str()));
  if (token.empty()) throw ConfigError(fmt::format("--token-file {}: the file is empty", token_file));
  return token;
}

}  // namespace cohort::tools
