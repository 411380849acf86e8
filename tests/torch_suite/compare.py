#!/usr/bin/env python3
"""Compares run_pytorch_suite.py's results for gloo and cohort (one JSON file per backend and world size).

    compare.py RESULTS_DIR        (files named <backend>-<world size>.json, as scripts/pytorch_suite.sh writes)

Prints, per world size: tests run, passed, failed, skipped for each backend, side by side (the table of
docs/pytorch.md); then every test that gloo passes and cohort does not, every test that cohort skips for a
reason gloo does not skip it for, every test that gloo skips and cohort fails, and the environment's failures (tests that fail for gloo too), with the
first line of their error. Exits 1 when cohort fails or is skipped anywhere gloo passes, or fails a test
that gloo skips.
"""
import glob
import json
import os
import re
import sys


def load(path):
    with open(path) as f:
        data = json.load(f)
    by_test = {}
    for row in data["results"]:
        by_test[row["test"]] = row
    return data, by_test


def same_reason(a, b):
    """Whether two skip reasons say the same. A set of backends printed in a reason ("Test requires
    backends to be available {'nccl', 'gloo'}") is compared without cohort, which the runner adds to the
    suite's feature sets, and without its (hash) order."""
    def norm(text):
        def set_text(m):
            items = sorted(x.strip() for x in m.group(1).split(",") if x.strip() and x.strip() != "'cohort'")
            return "{" + ", ".join(items) + "}"
        # "Test requires backend cohort to be one of {'nccl'}" is gloo's "... backend gloo ..." reason.
        text = re.sub(r"\bbackend (cohort|gloo)\b", "backend <this>", first_line(text))
        return re.sub(r"\{([^{}]*)\}", set_text, text)
    return norm(a) == norm(b)


def first_line(detail):
    lines = [l.strip() for l in detail.strip().splitlines() if l.strip()]
    # A traceback's last line says what was raised; a skip's reason is one line. torch 2.x's test cases
    # end a failure with how to rerun it ("To execute this test, run ...", "This message can be
    # suppressed ..."): the line that says what was raised is the last before those.
    for i, line in enumerate(lines):
        if line.startswith("To execute this test"):
            lines = lines[:i]
            break
    raised = [l for l in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Failure)\b", l)]
    return ((raised or lines or [""])[-1])[:160]


def main():
    results_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    runs = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*-*.json"))):
        m = re.fullmatch(r"([a-z]+)-([0-9]+)\.json", os.path.basename(path))
        if m:  # not the parts (<backend>-<world>.partN.json)
            runs[(m.group(1), int(m.group(2)))] = load(path)
    worlds = sorted({w for (_, w) in runs})
    bad = 0
    print("| torch | world size | backend | run | passed | failed | skipped |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for world in worlds:
        for backend in ("gloo", "cohort"):
            if (backend, world) not in runs:
                continue
            data, by_test = runs[(backend, world)]
            count = lambda s: sum(r["status"] == s for r in by_test.values())
            print(f"| {data['torch']} | {world} | {backend} | {len(by_test)} | {count('PASS')} | "
                  f"{count('FAIL') + count('ERROR')} | {count('SKIP')} |")
    for world in worlds:
        if ("gloo", world) not in runs or ("cohort", world) not in runs:
            continue
        _, gloo = runs[("gloo", world)]
        _, cohort = runs[("cohort", world)]
        missing = [t for t, r in gloo.items() if r["status"] == "PASS" and cohort.get(t, {}).get("status") != "PASS"]
        skipped = [t for t, r in cohort.items()
                   if r["status"] == "SKIP" and gloo.get(t, {}).get("status") == "SKIP"
                   and not same_reason(r["detail"], gloo[t]["detail"])]
        # gloo cannot run these here, yet cohort tried and failed: a failure of cohort's all the same.
        failed_where_gloo_skips = [t for t, r in cohort.items() if r["status"] in ("FAIL", "ERROR")
                                   and gloo.get(t, {}).get("status") == "SKIP"]
        both_fail = [t for t, r in gloo.items()
                     if r["status"] in ("FAIL", "ERROR") and cohort.get(t, {}).get("status") in ("FAIL", "ERROR")]
        print(f"\nworld size {world}:")
        print(f"  passed by gloo, not by cohort: {len(missing)}")
        for t in missing:
            row = cohort.get(t, {"status": "NOT RUN", "detail": ""})
            print(f"    {t}: {row['status']} {first_line(row['detail'])}")
        print(f"  skipped by both, for another reason with cohort: {len(skipped)}")
        for t in skipped:
            print(f"    {t}: cohort '{first_line(cohort[t]['detail'])}', gloo '{first_line(gloo[t]['detail'])}'")
        print(f"  skipped by gloo, failed by cohort: {len(failed_where_gloo_skips)}")
        for t in failed_where_gloo_skips:
            print(f"    {t}: {cohort[t]['status']} {first_line(cohort[t]['detail'])}, gloo skipped: "
                  f"'{first_line(gloo[t]['detail'])}'")
        print(f"  failed by both (the environment's): {len(both_fail)}")
        for t in both_fail:
            print(f"    {t}: {first_line(gloo[t]['detail'])}")
        bad += len(missing) + len(skipped) + len(failed_where_gloo_skips)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
