#pragma once
// Helpers shared by the launcher's tests (plan, parsers, GPU planning; the command lines of cohort run).

#include <string>
#include <utility>
#include <vector>

#include <sys/stat.h>

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "support/test_support.h"

namespace cohort::launch {

// The ConfigError message `f` throws, or "(no error)".
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

// The value of `k` in a worker environment, or "(unset)".
inline std::string env_value(const std::vector<std::pair<std::string, std::string>>& env, const std::string& k) {
  for (const auto& [name, v] : env)
    if (name == k) return v;
  return "(unset)";
}

// The workers of a job whose rank 0 fails while the others must go on (`--no-abort-on-failure`,
// mpirun's `-mca orte_abort_on_non_zero_status 0`), as one /bin/sh script. Rank 0 waits until every
// other rank runs, writes its pid and exits with code 4. Every other rank waits until the launcher
// has reaped rank 0 (its pid is gone), then lives 2 s longer before it writes DIR/done.RANK: longer
// than the report window (up to 1 s, docs/launcher.md) after which the default policy stops the
// survivors, so a done file appears only when the launcher really let them finish. (That one sleep
// outlasts a window of time; every ordering is a wait for its condition, each at most 10 s, after
// which the worker exits 3.)
inline std::string rank0_fails_others_outlast_the_report_window(const cohort::test::TempDir& dir) {
  return "d=" + dir.path() + R"(; i=0
wait_for() { until eval "$1"; do i=$((i + 1)); [ $i -gt 1000 ] && exit 3; sleep 0.01; done; i=0; }
if [ $RANK = 0 ]; then
  wait_for '[ $(ls $d | grep -c "^running\.") -ge $((WORLD_SIZE - 1)) ]'
  echo $$ > $d/pid0.tmp && mv $d/pid0.tmp $d/pid0
  exit 4
fi
: > $d/running.$RANK
wait_for '[ -s $d/pid0 ]'
wait_for '! kill -0 $(cat $d/pid0) 2>/dev/null'
sleep 2
echo done > $d/done.$RANK)";
}

}  // namespace cohort::launch

namespace cohort::test {

// `argv` running `script` under /bin/sh (the program of a cohort_run line).
inline std::vector<std::string> with_sh(std::vector<std::string> argv, const std::string& script) {
  argv.insert(argv.end(), {"/bin/sh", "-c", script});
  return argv;
}

// The ssh stand-in: "shim [ssh options] HOST COMMAND..." runs COMMAND here as if on HOST.
inline std::string write_shim(const TempDir& dir) {
  std::string path = dir.file("fake-ssh");
  write_file(path,
             "#!/bin/sh\n"
             "while [ \"${1#-}\" != \"$1\" ]; do if [ \"$1\" = -o ]; then shift; fi; shift; done\n"
             "host=$1; shift\n"
             "COHORT_HOST_ID=$host exec \"$@\"\n");
  chmod(path.c_str(), 0755);
  return path;
}

// A bad command line: exit 2 and exactly `line` on stderr.
inline void expect_refused(const std::vector<std::string>& argv, const std::string& line) {
  auto r = run_process(argv, {}, 30);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err, line + "\n");
}

}  // namespace cohort::test
