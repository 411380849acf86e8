// `cohort`: the single command-line entry point (run, agent, store serve, bench ..., doctor).
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "cohort/error.h"
#include "cohort/version.h"
#include "command.h"
#include "common/build_info.h"

namespace cohort::tools {
namespace {

struct Entry {
  std::string summary;
  CommandFn fn;
};

std::map<std::string, Entry>& commands() {
  static std::map<std::string, Entry> m;
  return m;
}

void print_usage(FILE* out) {
  fmt::print(out, "usage: cohort <command> [options]\n\ncommands:\n");
  for (const auto& [name, e] : commands()) fmt::print(out, "  {:<20} {}\n", name, e.summary);
  fmt::print(out, "\n'cohort <command> --help' describes each command; 'cohort --version' prints the version.\n");
}

// The commands of a group ("bench", "store"), or none when `word` is not the first word of a
// two-word command.
std::vector<std::string> group_commands(const std::string& word) {
  std::vector<std::string> names;
  for (const auto& [name, e] : commands())
    if (name.rfind(word + " ", 0) == 0) names.push_back(name);
  return names;
}

void print_group_usage(FILE* out, const std::string& group) {
  fmt::print(out, "usage: cohort {} <command> [options]\n\ncommands:\n", group);
  for (const auto& name : group_commands(group)) fmt::print(out, "  {:<20} {}\n", name, commands()[name].summary);
  fmt::print(out, "\n'cohort {} <command> --help' describes each one.\n", group);
}

}  // namespace

Registration::Registration(std::string name, std::string summary, CommandFn fn) {
  commands()[std::move(name)] = Entry{std::move(summary), std::move(fn)};
}

}  // namespace cohort::tools

int main(int argc, char** argv) {
  using namespace cohort::tools;
  std::vector<std::string> args(argv + 1, argv + argc);
  // Installed under the name `horovodrun` too (a link to this tool): then it is `cohort horovodrun`.
  std::string invoked = argc > 0 ? argv[0] : "";
  if (invoked.substr(invoked.rfind('/') + 1) == "horovodrun") args.insert(args.begin(), "horovodrun");
  if (args.empty() || args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
    print_usage(args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version" || args[0] == "version") {
    fmt::print("cohort {}\n", cohort::build::version_text());
    return 0;
  }
  // Longest match: two words first ("bench store"), then one ("run").
  std::string name;
  size_t consumed = 0;
  if (args.size() >= 2 && commands().count(args[0] + " " + args[1])) {
    name = args[0] + " " + args[1];
    consumed = 2;
  } else if (commands().count(args[0])) {
    name = args[0];
    consumed = 1;
  } else if (!group_commands(args[0]).empty()) {
    // A group word alone, with --help, or with a second word that is not one of its commands.
    const bool help = args.size() >= 2 && (args[1] == "-h" || args[1] == "--help" || args[1] == "help");
    if (args.size() >= 2 && !help) {
      std::vector<std::string> words;
      for (const auto& full : group_commands(args[0])) words.push_back(full.substr(args[0].size() + 1));
      std::string guess = closest_match(args[1], words);
      fmt::print(stderr, "cohort {}: unknown command '{}'{} (cohort {} --help lists its commands)\n", args[0], args[1],
                 guess.empty() ? "" : fmt::format("; did you mean 'cohort {} {}'?", args[0], guess), args[0]);
      return 2;
    }
    print_group_usage(help ? stdout : stderr, args[0]);
    return help ? 0 : 2;
  } else {
    // One line, with the command that was probably meant ("rnu": run).
    std::vector<std::string> words;
    for (const auto& [name, e] : commands()) words.push_back(name.substr(0, name.find(' ')));
    std::string guess = closest_match(args[0], words);
    fmt::print(stderr, "cohort: unknown command '{}'{} (cohort --help lists the commands)\n", args[0],
               guess.empty() ? "" : fmt::format("; did you mean 'cohort {}'?", guess));
    return 2;
  }
  std::vector<std::string> rest;
  rest.push_back(name);
  rest.insert(rest.end(), args.begin() + static_cast<long>(consumed), args.end());
  try {
    return commands()[name].fn(std::move(rest));
  } catch (const cohort::ConfigError& e) {
    fmt::print(stderr, "cohort {}: {}\n", name, e.what());
    return 2;
  } catch (const cohort::InvalidArgument& e) {
    fmt::print(stderr, "cohort {}: {}\n", name, e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "cohort {}: {}\n", name, e.what());
    return 1;
  }
}
