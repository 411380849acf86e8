#!/usr/bin/env bash
# Quick start, second command: installs dependencies, builds, and runs the whole test suite.
#   scripts/test.sh                 everything (unit, multi-process, multi-host when namespaces work)
#   scripts/test.sh -L store        only tests labelled 'store' (any ctest arguments pass through)
#   COHORT_SANITIZERS=0 scripts/test.sh   skip the sanitizer builds (scripts/sanitize.sh), which otherwise
#                                   run after the ordinary suite when no ctest arguments are given
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir=${COHORT_BUILD_DIR:-build}
cd "$build_dir"
# Two cores: run two tests at a time; every test has its own timeout.
rc=0
ctest --output-on-failure -j 2 "$@" || rc=$?
# GPU tests skip themselves without a GPU: say which, and why.
cd - >/dev/null
scripts/skipped_tests.sh "$build_dir"
# The same code under ASan + UBSan and TSan (the whole suite only: a filtered run is a quick look).
if [[ $# -eq 0 && ${COHORT_SANITIZERS:-1} != 0 ]]; then
  scripts/sanitize.sh || rc=1
fi
exit $rc
