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

}  // namespace cohort::test
