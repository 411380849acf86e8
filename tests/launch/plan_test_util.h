#pragma once
// What the plan builder's tests (plan_*test.cc, one file per placement source as in src/launch/plan_*.cc)
// build their plans from: a machine whose facts the test controls and a command line with a program.

#include <string>

#include "launch/plan.h"

namespace cohort::launch {

inline std::string fake_resolve(const std::string& p) { return "/bin/" + p; }

// "here": 6 CPUs, no GPU, every program found in /bin.
inline MachineFacts facts() {
  MachineFacts m;
  m.hostname = "here";
  m.cpu_count = 6;
  m.gpu_count = 0;
  m.resolve_program = &fake_resolve;
  return m;
}

// `cohort run ... train --lr 0.1`: the options of a command line that names a program and nothing else.
inline Options with_program() {
  Options o;
  o.program = {"train", "--lr", "0.1"};
  return o;
}

}  // namespace cohort::launch
