#!/usr/bin/env bash
# A skipped test is never counted as passed without a word:
#  - scripts/skipped_tests.sh lists the tests a ctest run skipped by exit code 77 (the shell tests'
#    SKIP_RETURN_CODE, which LastTest.log calls "Test Passed.") as well as by a skip regex, each with
#    its reason, and fails when a skip gives no reason; scripts/test.sh asks ctest for the JUnit file
#    that this needs;
#  - tests/multihost/lib.sh's require_command fails (exit 1), never skips, when the built cohort lacks
#    the command or crashes: every multi-host and Slurm test calls it first.
#   tests/repo/skips.sh SOURCE_DIR COHORT_TOOL
set -euo pipefail
src=$(cd "$1" && pwd)
tool=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/cohort-skips.XXXXXX")
trap 'rm -rf "$work"' EXIT
failures=0
pass() { echo "ok: $*"; }
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# 1. A small ctest project whose tests skip each way, run as scripts/test.sh runs the suite.
junit=$(grep -o -- '--output-junit [^ ]*' "$src/scripts/test.sh" || true)
[[ $junit == "--output-junit Testing/Temporary/LastTest.junit.xml" ]] && pass "scripts/test.sh asks ctest for the JUnit file" ||
  fail "scripts/test.sh does not run ctest with --output-junit Testing/Temporary/LastTest.junit.xml (found '$junit')"
make_project() {  # make_project DIR [silent]: the tests; with "silent", one skip that gives no reason
  mkdir -p "$1"
  cat >"$1/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.20)
project(skips NONE)
enable_testing()
add_test(NAME passes COMMAND sh -c "echo fine")
add_test(NAME exit77 COMMAND sh -c "echo 'SKIP: multihost cluster unavailable: no netns'; exit 77")
set_tests_properties(exit77 PROPERTIES SKIP_RETURN_CODE 77)
add_test(NAME pytest_skip COMMAND sh -c "echo 'SKIPPED [1] t.py:3: torchrun cannot start'; echo '1 skipped in 0.1s'")
set_tests_properties(pytest_skip PROPERTIES SKIP_REGULAR_EXPRESSION "[0-9]+ skipped")
EOF
  [[ ${2:-} != silent ]] || cat >>"$1/CMakeLists.txt" <<'EOF'
add_test(NAME silent77 COMMAND sh -c "echo nothing to say; exit 77")
set_tests_properties(silent77 PROPERTIES SKIP_RETURN_CODE 77)
EOF
  cmake -S "$1" -B "$1/build" >/dev/null
  (cd "$1/build" && ctest $junit >/dev/null)
}
make_project "$work/p1"
out=$("$src/scripts/skipped_tests.sh" "$work/p1/build" 2>&1) && rc=0 || rc=$?
[[ $rc == 0 ]] && pass "skipped_tests.sh: exit 0 when every skip gives its reason" || fail "skipped_tests.sh exited $rc: $out"
grep -qE '^  exit77 +multihost cluster unavailable: no netns$' <<<"$out" && pass "a skip by exit code 77 is listed, with its reason" ||
  fail "the exit-77 skip is not listed with its reason in: $out"
grep -qE '^  pytest_skip +torchrun cannot start$' <<<"$out" && pass "a pytest skip is listed, with its reason" ||
  fail "the pytest skip is not listed with its reason in: $out"
grep -q '^2 test(s) skipped' <<<"$out" && ! grep -q passes <<<"$out" && pass "the count is the two skips" ||
  fail "expected '2 test(s) skipped' and no 'passes' in: $out"

make_project "$work/p2" silent
out=$("$src/scripts/skipped_tests.sh" "$work/p2/build" 2>&1) && rc=0 || rc=$?
[[ $rc == 1 ]] && grep -q 'silent77 .*NO REASON GIVEN' <<<"$out" && pass "a skip without a reason fails, named" ||
  fail "a skip without a reason: exit $rc (expected 1) and output: $out"

# 2. require_command (tests/multihost/lib.sh), against the real tool and one whose commands crash.
req() {  # req TOOL COMMAND: require_command's exit code, its output in $req_out
  req_out=$(COHORT_TOOL=$1 bash -c 'source "$0"; require_command "$1"; echo "went on"' \
            "$src/tests/multihost/lib.sh" "$2" 2>&1) && req_rc=0 || req_rc=$?
}
req "$tool" "bench allreduce"
[[ $req_rc == 0 && $req_out == *"went on"* ]] && pass "require_command 'bench allreduce' with the built tool" ||
  fail "require_command 'bench allreduce' with $tool: exit $req_rc: $req_out"
printf '#!/bin/sh\nkill -SEGV $$\n' >"$work/crashing-cohort"
chmod +x "$work/crashing-cohort"
req "$work/crashing-cohort" run
[[ $req_rc == 1 && $req_out == *"FAIL: '$work/crashing-cohort run --help' exited 139"* ]] &&
  pass "require_command fails (exit 1, not the skip's 77) when the tool crashes" ||
  fail "require_command with a crashing tool: exit $req_rc (expected 1): $req_out"
req "$tool" "no-such-command"
[[ $req_rc == 1 ]] && pass "require_command fails for a command this build lacks" ||
  fail "require_command 'no-such-command': exit $req_rc (expected 1): $req_out"

((failures == 0)) || { echo "$failures check(s) failed" >&2; exit 1; }
echo "all checks passed"
