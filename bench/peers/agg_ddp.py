#!/usr/bin/python3
"""A markdown table from ddp_train.py's RESULT lines (run_ddp.sh's output): per configuration, the median
(min .. max) samples/s over repetitions, the median step and epoch times and the test accuracies seen.
Usage: agg_ddp.py [FILE]   (default: standard input)
"""
import collections
import re
import statistics
import sys

source = open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin
runs = collections.defaultdict(list)
for line in source:
    if line.startswith("RESULT train"):
        kv = dict(re.findall(r"(\w+)=(\S+)", line))
        runs[(kv.get("blas", "-"), kv["model"], kv["loader"], int(kv["procs"]), int(kv["threads"]))].append(kv)

print("| BLAS | model | loader | processes | threads/proc | samples/s median (min .. max) | step ms median "
      "| epoch s median | test acc | reps |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
for key in sorted(runs, key=lambda k: (k[0] != "netlib", k[1] != "tiny", k[2], k[3], k[4])):
    blas, model, loader, procs, threads = key
    reps = runs[key]
    rate = [float(r["samples_per_s"]) for r in reps]
    step = statistics.median(float(r["step_ms"]) for r in reps)
    epoch = statistics.median(float(r["epoch_s"]) for r in reps)
    accuracy = "/".join(sorted({r["test_acc"] for r in reps}))
    print(f"| {blas} | {model} | {loader} | {procs}{' (DDP)' if procs > 1 else ''} | {threads} "
          f"| {statistics.median(rate):,.0f} ({min(rate):,.0f} .. {max(rate):,.0f}) | {step:.3f} | {epoch:.2f} "
          f"| {accuracy} | {len(reps)} |")
