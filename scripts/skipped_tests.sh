#!/usr/bin/env bash
# Prints each test of the last ctest run that was skipped, with the reason it gave (GoogleTest's
# GTEST_SKIP message, pytest's "SKIPPED [1] ...: why"), from <build>/Testing/Temporary/LastTest.log.
#   scripts/skipped_tests.sh [build dir (default build)]
set -euo pipefail
log=${1:-build}/Testing/Temporary/LastTest.log
[[ -f $log ]] || exit 0
awk '
  /^[0-9]+\/[0-9]+ Test: / { name = $3; reason = ""; next_is_reason = 0 }
  next_is_reason { if (reason == "") reason = $0; next_is_reason = 0 }
  /: Skipped$/ { next_is_reason = 1 }
  /^SKIPPED \[[0-9]+\]/ { if (reason == "") { sub(/^SKIPPED \[[0-9]+\] [^ ]*: /, ""); reason = $0 } }
  /^Skip regular expression found in output/ { printf "  %-60s %s\n", name, reason; n++ }
  END { if (n) printf "%d test(s) skipped (above: which, and why)\n", n }
' "$log" | { out=$(cat); [[ -z $out ]] || printf 'skipped tests:\n%s\n' "$out"; }
