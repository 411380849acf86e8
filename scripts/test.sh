#!/usr/bin/env bash
# Quick start, second command: installs dependencies, builds, and runs the whole test suite.
#   scripts/test.sh                 everything (unit, multi-process, multi-host when namespaces work)
#   scripts/test.sh -L store        only tests labelled 'store' (any ctest arguments pass through)
#   COHORT_SANITIZERS=0 scripts/test.sh   skip the sanitizer builds (scripts/sanitize.sh), which otherwise
#                                   run after the ordinary suite when no ctest arguments are given
set -euo pipefail
cd "$(dirname "$0")/.."
# The whole suite: the .deb test's clean Debian 12 root is made while the code compiles
# (tests/install/test_deb.sh waits for it).
if [[ $# -eq 0 && $(id -u) -eq 0 ]]; then
  export COHORT_SETUP_BACKGROUND="tests/install/test_deb.sh --prepare"
fi
scripts/setup.sh
build_dir=${COHORT_BUILD_DIR:-build}
sanitizers=0
[[ $# -eq 0 && ${COHORT_SANITIZERS:-1} != 0 ]] && sanitizers=1
# The sanitizer builds compile while the ordinary suite runs, at the lowest CPU priority (SCHED_IDLE),
# on the CPU its tests leave idle: most of them wait on processes, sockets and deadlines, and the
# multi-host tests that run alone use about one core. scripts/sanitize.sh below waits for each
# tree's background build (and prints its output) before it runs that tree's tests.
if ((sanitizers)); then
  # In a process group of its own (set -m), ended with this script if it stops early (Ctrl-C, a failed
  # step). Not setsid: a new session is a new autogroup, which the kernel (sched_autogroup_enabled)
  # schedules as an equal of this one, SCHED_IDLE or not -- measured here, an idle spinner in its own
  # session took half of a core from a test's, in this session a sixth of a nice-19 one's.
  set -m
  scripts/sanitize.sh --build-only </dev/null >/dev/null 2>&1 &
  background_build=$!
  set +m
  trap 'kill -- -"$background_build" 2>/dev/null || true' EXIT
fi
cd "$build_dir"
# Two cores: run two tests at a time; every test has its own timeout.
rc=0
rm -f Testing/Temporary/LastTestsFailed.log Testing/Temporary/LastTest.junit.xml
# The JUnit file is where a test skipped by its exit code (77) shows as skipped; LastTest.log says
# "Test Passed." for it (scripts/skipped_tests.sh).
ctest --output-on-failure -j 2 --output-junit Testing/Temporary/LastTest.junit.xml "$@" || rc=$?
# Every skip, with its reason (the GPU tests without a GPU, the multi-host tests without namespaces);
# a skip that gives no reason fails the run.
cd - >/dev/null
scripts/skipped_tests.sh "$build_dir" || rc=1
ordinary_rc=$rc
# The same code under ASan + UBSan and TSan (the whole suite only: a filtered run is a quick look).
if ((sanitizers)); then
  scripts/sanitize.sh || rc=1
fi
# The ordinary suite's failures again, last: its own report scrolled away under the sanitizer stages,
# and a CI log is often read from its tail.
failed_log=$build_dir/Testing/Temporary/LastTestsFailed.log
if [[ $ordinary_rc != 0 && -s $failed_log ]]; then
  echo "the ordinary suite's failed tests (ctest number:name; details above, and in $build_dir/Testing/Temporary/LastTest.log):"
  sed 's/^/  /' "$failed_log"
  # The last lines each failed test printed.
  while IFS=: read -r _ name; do
    echo "--- last lines of $name:"
    awk -v t="$name" '$0 ~ /^[0-9]+\/[0-9]+ Test: / { on = ($3 == t) } on' "$build_dir/Testing/Temporary/LastTest.log" |
      sed -n '/^Output:/,/^<end of output>/p' | tail -n 25
  done <"$failed_log"
fi
exit $rc
