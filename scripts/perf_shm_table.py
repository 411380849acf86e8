#!/usr/bin/python3
"""Turns scripts/bench_shm_vs_peers.sh output (RESULT lines) into the markdown tables of docs/perf-shm.md:
per op, one row per size, busbw GB/s (median time per op) for each peer, median over the rounds."""
import re
import statistics
import sys
from collections import defaultdict

PEERS = [("cohort-shm", "cohort shm::Group"), ("mpi", "Open MPI default (vader)"), ("torch-gloo", "torch gloo")]


def fmt_time(us):
    if us < 1000:
        return f"{us:.2f} µs"
    if us < 1e6:
        return f"{us / 1000:.2f} ms"
    return f"{us / 1e6:.2f} s"


def fmt_size(b):
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m and b % m == 0:
            return f"{b // m} {unit}"
    return f"{b} B"


def main(path):
    runs = defaultdict(list)  # (op, peer, bytes) -> [(time_us, busbw)]
    membw = defaultdict(list)
    for line in open(path):
        if "RESULT" not in line:
            continue
        kv = dict(re.findall(r"(\w+)=([^ ]+)", line))
        if "threads" in kv:
            membw[int(kv["threads"])].append((float(kv["memcpy_median"]), float(kv["reduce_median"])))
            continue
        # busbw/algbw is the op's bus factor (allreduce 2(n-1)/n, allgather (n-1)/n, broadcast 1)
        factor = float(kv["busbw_GBps"]) / float(kv["algbw_GBps"]) if float(kv["algbw_GBps"]) > 0 else 1.0
        if kv["op"] == "allreduce":
            factor = 2 * (int(kv["n"]) - 1) / int(kv["n"])
        elif kv["op"] == "allgather":
            factor = (int(kv["n"]) - 1) / int(kv["n"])
        elif kv["op"] == "broadcast":
            factor = 1.0
        runs[(kv["op"], kv["peer"], int(kv["bytes"]))].append((float(kv["time_us_median"]), factor))
    for t, vals in sorted(membw.items()):
        cp = statistics.median(v[0] for v in vals)
        rd = statistics.median(v[1] for v in vals)
        print(f"memcpy, {t} thread(s): {cp:.2f} GB/s (runs: {', '.join(f'{v[0]:.2f}' for v in vals)}); "
              f"a[i]+=b[i]: {rd:.2f} GB/s")
    print()
    for op in ("allreduce", "allgather", "broadcast"):
        sizes = sorted({b for (o, _, b) in runs if o == op})
        if not sizes:
            continue
        print(f"#### {op}, n=2: busbw GB/s (median time per op), median over {max(len(v) for v in runs.values())} round(s) of the per-round medians\n")
        print("| size | " + " | ".join(name for _, name in PEERS) + " |")
        print("|---:|" + "---:|" * len(PEERS))
        for b in sizes:
            cells = []
            for peer, _ in PEERS:
                vals = runs.get((op, peer, b))
                if not vals:
                    cells.append("–")
                    continue
                t = statistics.median(v[0] for v in vals)  # with 2 rounds: the mean of the two
                bw = vals[0][1] * b / (t * 1e-6) / 1e9  # busbw of the median time
                cells.append(f"{bw:.3g} ({fmt_time(t)})")
            print(f"| {fmt_size(b)} | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "perf-shm-raw.txt")
