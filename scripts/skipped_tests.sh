#!/usr/bin/env bash
# Prints each test of the last ctest run that was skipped, with the reason it gave, and fails (exit 1)
# when a skipped test gave none: a skip must say why this machine cannot run the test.
#   scripts/skipped_tests.sh [build dir (default build)]
# A skip is either ctest's skip regex matching the output (GoogleTest's "[  SKIPPED ]", pytest's
# "N skipped") or the exit code 77 (SKIP_RETURN_CODE: the shell tests of tests/multihost, tests/slurm,
# tests/install). ctest's LastTest.log calls the second kind "Test Passed.", so the list comes from
# the JUnit file that scripts/test.sh asks ctest for (Testing/Temporary/LastTest.junit.xml) when it is
# from the same run as LastTest.log; without it (a plain `ctest`), only the first kind is seen.
# The reason is GoogleTest's GTEST_SKIP message, pytest's "SKIPPED [1] file:line: why" (-rs) or a
# shell test's "SKIP: why" line.
set -euo pipefail
tmp=${1:-build}/Testing/Temporary
[[ -f $tmp/LastTest.log ]] || exit 0
exec python3 - "$tmp/LastTest.log" "$tmp/LastTest.junit.xml" <<'EOF'
import os
import re
import sys
import xml.etree.ElementTree as ET

log_path, junit_path = sys.argv[1], sys.argv[2]

# Each test's output in LastTest.log, and the tests whose skip regex matched.
outputs, regex_skipped = {}, []
name, lines, in_output = None, [], False
with open(log_path, errors="replace") as log:
    for line in log:
        line = line.rstrip("\n")
        m = re.match(r"^[0-9]+/[0-9]+ Test: (\S+)", line)
        if m:
            name, lines, in_output = m.group(1), [], False
        elif line == "<end of output>":
            in_output = False
            outputs[name] = lines
        elif in_output:
            lines.append(line)
        elif line.startswith("Output:"):
            in_output = True
        elif line.startswith("Skip regular expression found in output") and name:
            regex_skipped.append(name)

skipped = regex_skipped
# ctest writes the JUnit file right after LastTest.log; an older one is another run's.
if os.path.exists(junit_path) and os.path.getmtime(junit_path) + 1 >= os.path.getmtime(log_path):
    skipped = [case.get("name") for case in ET.parse(junit_path).getroot().iter("testcase")
               if case.get("status") == "notrun" and case.find("skipped") is not None]


def reason(lines):
    for i, line in enumerate(lines):
        if line.endswith(": Skipped") and i + 1 < len(lines) and lines[i + 1].strip():
            return lines[i + 1].strip()  # GoogleTest: "file:line: Skipped", then the message
        m = re.match(r"^SKIPPED \[[0-9]+\] \S+: (.*)", line)
        if m:
            return m.group(1)  # pytest -rs
        m = re.match(r"^SKIP: (.*)", line)
        if m:
            return m.group(1)  # the shell tests
    return None


if skipped:
    print("skipped tests:")
    silent = 0
    for test in skipped:
        why = reason(outputs.get(test, []))
        silent += why is None
        print(f"  {test:<60} {why or '(NO REASON GIVEN: a skip must say why this machine cannot run it)'}")
    print(f"{len(skipped)} test(s) skipped (above: which, and why)")
    if silent:
        print(f"skipped_tests.sh: {silent} skipped test(s) gave no reason (above)", file=sys.stderr)
        sys.exit(1)
EOF
