#pragma once
// Sub-command registry of the `cohort` tool. Each sub-command lives in its own cmd_*.cc file and
// registers itself with a static Registration, so adding one never touches the dispatcher:
//
//   static cohort::tools::Registration reg("bench store", "measure store join time", run_bench_store);
//
// Names may have two words ("store serve", "bench allreduce"); the longest match wins.
// A command returns the process exit code (0 ok, 1 failure, 2 usage error).

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace cohort::tools {

// argv[0] is the command name (e.g. "bench store"); the rest are its arguments.
using CommandFn = std::function<int(std::vector<std::string> args)>;

struct Registration {
  Registration(std::string name, std::string summary, CommandFn fn);
};

// Parses a command's arguments (`args[0]` is its name, as a CommandFn receives them) with `app`.
// Returns false when --help was asked for: the help (and `after_help`) is printed and the command
// returns 0. A bad flag throws ConfigError, one line naming the flag as the user spelled it and what
// was expected ("unknown flag --nproc-pre-node (did you mean --nproc-per-node?)", "-n given twice
// (-n 2, -n 3); give it once", "--node-rank abc: expected a whole number") and ending "(cohort <name>
// --help lists the flags)"; main prints it and exits with 2.
bool parse_command_line(CLI::App& app, const std::vector<std::string>& args, const std::string& after_help = "");

// The candidate closest to `word` (edit distance, adjacent swaps counting as one edit, '_' the same as
// '-'), or "" when none is close enough to be what was meant.
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);

// The job token for a store: the trimmed contents of `token_file` when one is given (ConfigError
// naming the file when it cannot be read or is empty), else COHORT_JOB_TOKEN, else "".
std::string job_token(const std::string& token_file);

// The launcher's command lines, all run by `cohort run`'s code (tools/cmd_run.cc): its own; `cohort launch`
// (python -m torch.distributed.launch's: --local_rank=N for every worker unless --use-env); `cohort
// horovodrun` (horovodrun's line, translated by tools/cmd_horovodrun.cc into cohort run's flags: Horovod's
// variables for every worker). `args[0]` is the command's name, as a CommandFn receives it.
enum class LaunchLine { kRun, kTorchLaunch, kHorovodrun };
int run_launcher_line(std::vector<std::string> args, LaunchLine line);

}  // namespace cohort::tools
