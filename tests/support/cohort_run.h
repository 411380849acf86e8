#pragma once
// `cohort run` command lines for the tests that start the real launcher (a header of its own so that
// the many tests that do not are not rebuilt when it changes).

#include <string>
#include <vector>

#include "support/test_support.h"

namespace cohort::test {

// `cohort run ARGS...` as an argv for run_process (the program to run goes after `args`).
inline std::vector<std::string> cohort_run(std::vector<std::string> args) {
  args.insert(args.begin(), {cohort_tool(), "run"});
  return args;
}

#ifdef COHORT_COMM_WORKER
// `cohort run -n N FLAGS... comm_worker MODE env 0 0`: N ranks of tests/comm/comm_worker.cc in MODE,
// each placed by the launcher's environment (the test targets that build beside the worker define
// COHORT_COMM_WORKER as its path).
inline std::vector<std::string> run_workers(int n, const std::string& mode, std::vector<std::string> flags = {}) {
  std::vector<std::string> argv = cohort_run({"-n", std::to_string(n)});
  argv.insert(argv.end(), flags.begin(), flags.end());
  for (std::string a : {std::string(COHORT_COMM_WORKER), mode, std::string("env"), std::string("0"), std::string("0")})
    argv.push_back(a);
  return argv;
}
#endif

}  // namespace cohort::test
