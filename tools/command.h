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

namespace cohort::tools {

// argv[0] is the command name (e.g. "bench store"); the rest are its arguments.
using CommandFn = std::function<int(std::vector<std::string> args)>;

struct Registration {
  Registration(std::string name, std::string summary, CommandFn fn);
};

}  // namespace cohort::tools
