#!/usr/bin/python3
"""Tables for docs/perf-pytorch.md from run_perf.sh output (RESULT lines on stdin).

allreduce: per backend and size, the median over rounds of each round's median time/op
(the peers' aggregation in bench/peers/aggregate.py); busbw = size/time * 2(n-1)/n.
DDP: median samples/s over rounds, with min..max."""
import re
import statistics
import sys
from collections import defaultdict


def fields(line):
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S+)", line))


coll = defaultdict(list)   # (backend, bytes) -> [time_us]
ddp = defaultdict(list)    # backend -> [samples/s]
n = 2
for line in sys.stdin:
    if not line.startswith("RESULT"):
        continue
    f = fields(line)
    if line.startswith("RESULT peer="):
        coll[(f["peer"].replace("torch-", ""), int(f["bytes"]))].append(float(f["time_us_median"]))
        n = int(f["n"])
    elif line.startswith("RESULT train"):
        ddp[f["backend"]].append(float(f["samples_per_s"]))


def human(b):
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m:
            return f"{b // m} {unit}"
    return f"{b} B"


def fmt_time(us):
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} µs"


sizes = sorted({b for _, b in coll})
if sizes:
    print(f"| size | gloo busbw GB/s (time/op) | cohort busbw GB/s (time/op) | cohort / gloo |")
    print("|---:|---:|---:|---:|")
    for b in sizes:
        row = [human(b)]
        t = {}
        for be in ("gloo", "cohort"):
            ts = coll.get((be, b))
            if not ts:
                row.append("–")
                continue
            t[be] = statistics.median(ts)
            busbw = b / (t[be] * 1e-6) / 1e9 * 2 * (n - 1) / n
            row.append(f"{busbw:.3f} ({fmt_time(t[be])})")
        row.append(f"{t['gloo'] / t['cohort']:.2f}x" if len(t) == 2 else "–")
        print("| " + " | ".join(row) + " |")
    rounds = max(len(v) for v in coll.values())
    print(f"\n(n = {n}, {rounds} rounds per backend)\n")
if ddp:
    print("| backend | DDP samples/s median (min .. max) | rounds |")
    print("|---|---:|---:|")
    med = {}
    for be in ("gloo", "cohort"):
        v = ddp.get(be)
        if v:
            med[be] = statistics.median(v)
            print(f"| {be} | {med[be]:,.0f} ({min(v):,.0f} .. {max(v):,.0f}) | {len(v)} |")
    if len(med) == 2:
        print(f"\ncohort / gloo DDP samples/s: {med['cohort'] / med['gloo']:.2f}x")
