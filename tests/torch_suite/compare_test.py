#!/usr/bin/env python3
"""compare.py judges cohort against gloo from result files like scripts/pytorch_suite.sh's: it must
exit 1 (and name the test) whenever cohort fails where gloo passes or skips, and 0 when cohort does
what gloo does. No torch needed: the result files are written here.

    compare_test.py
"""
import json
import os
import subprocess
import sys
import tempfile

COMPARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare.py")


def compare(gloo_rows, cohort_rows):
    with tempfile.TemporaryDirectory(prefix="cohort-compare.") as d:
        for backend, rows in (("gloo", gloo_rows), ("cohort", cohort_rows)):
            with open(os.path.join(d, f"{backend}-2.json"), "w") as f:
                json.dump({"torch": "test", "results": [
                    {"test": t, "status": s, "seconds": 0.1, "detail": detail} for t, s, detail in rows]}, f)
        return subprocess.run([sys.executable, COMPARE, d], capture_output=True, text=True, timeout=60)


failures = []


def expect(what, cond, proc):
    print(("ok: " if cond else "FAIL: ") + what)
    if not cond:
        failures.append(what)
        print(proc.stdout + proc.stderr)


same = [("test_all_reduce_sum", "PASS", ""), ("test_nccl_only", "SKIP", "Test requires backend nccl")]
p = compare(same, same)
expect("cohort doing what gloo does: exit 0", p.returncode == 0, p)

p = compare(same, [("test_all_reduce_sum", "PASS", ""),
                   ("test_nccl_only", "FAIL", "Traceback\nRuntimeError: cohort: no such op")])
expect("a test gloo skips and cohort fails: exit 1", p.returncode == 1, p)
expect("... listed by name with cohort's error",
       "test_nccl_only: FAIL RuntimeError: cohort: no such op" in p.stdout, p)
expect("... counted", "skipped by gloo, failed by cohort: 1" in p.stdout, p)

p = compare(same, [("test_all_reduce_sum", "ERROR", "Traceback\nValueError: bad"), same[1]])
expect("a test gloo passes and cohort errs: exit 1", p.returncode == 1 and "passed by gloo, not by cohort: 1" in p.stdout, p)

sys.exit(1 if failures else 0)
