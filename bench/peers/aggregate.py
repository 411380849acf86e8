#!/usr/bin/python3
"""Markdown tables from the RESULT lines of the collective peers (run_collectives.sh's output).

Usage: aggregate.py [FILE]   (default: standard input)
Per (peer, op, ranks, size): time = the median over launches of each launch's median trial; the spread
is the lowest trial minimum .. the highest trial maximum over all launches; algbw = bytes / time
(GB/s, 1e9 B/s); busbw as nccl-tests: allreduce 2(n-1)/n, broadcast 1, allgather (n-1)/n of algbw.
One busbw table per op and rank count, then a full-numbers table per peer.
"""
import collections
import re
import statistics
import sys

PEERS = {  # RESULT peer= value -> column title, in column order
    "torch-gloo": "torch.distributed gloo",
    "mpi": "Open MPI default (vader shm)",
    "mpi-tcp": "Open MPI btl tcp,self",
    "gloo-cpp-ring": "Gloo C++ AllreduceRing",
    "gloo-cpp-ring_chunked": "Gloo C++ AllreduceRingChunked",
    "gloo-cpp-new": "Gloo C++ allreduce (new API)",
}
BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0, "allgather": lambda n: (n - 1) / n}


def human_size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB" if b >= 1 << 10 else f"{b} B"


def human_time(us):
    if us >= 10000:
        return f"{us / 1000:.1f} ms"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.1f} µs" if us >= 10 else f"{us:.2f} µs"


def human_bw(x):
    return f"{x:.3f}" if x < 0.1 else f"{x:.2f}"


def main():
    source = open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin
    rows = collections.defaultdict(list)  # (peer, op, n, bytes) -> one dict per launch
    for line in source:
        if "RESULT" in line and "op=" in line:
            kv = dict(re.findall(r"(\w+)=(\S+)", line))
            rows[(kv["peer"], kv["op"], int(kv["n"]), int(kv["bytes"]))].append(kv)

    def stats(key):
        launches = rows[key]
        median = statistics.median(float(r["time_us_median"]) for r in launches)
        low = min(float(r["time_us_min"]) for r in launches)
        high = max(float(r["time_us_max"]) for r in launches)
        algbw = key[3] / (median * 1e-6) / 1e9
        return median, low, high, algbw, algbw * BUS_FACTOR[key[1]](key[2])

    for op in BUS_FACTOR:
        for n in sorted({k[2] for k in rows if k[1] == op}):
            peers = [p for p in PEERS if any(k[:3] == (p, op, n) for k in rows)]
            sizes = sorted({k[3] for k in rows if k[1:3] == (op, n)})
            print(f"\n#### {op}, n={n}: busbw GB/s (median time per op)\n")
            print("| size | " + " | ".join(PEERS[p] for p in peers) + " |")
            print("|---:|" + "---:|" * len(peers))
            for size in sizes:
                cells = []
                for p in peers:
                    if (p, op, n, size) in rows:
                        median, _, _, _, busbw = stats((p, op, n, size))
                        cells.append(f"{human_bw(busbw)} ({human_time(median)})")
                    else:
                        cells.append("–")
                print(f"| {human_size(size)} | " + " | ".join(cells) + " |")
            for p in peers:
                print(f"\n{op} n={n} {PEERS[p]}, full numbers:\n")
                print("| size | time/op median | trial min .. max | algbw GB/s | busbw GB/s | iters/trial | launches |")
                print("|---:|---:|---:|---:|---:|---:|---:|")
                for size in sizes:
                    key = (p, op, n, size)
                    if key in rows:
                        median, low, high, algbw, busbw = stats(key)
                        iters = "/".join(sorted({r["iters"] for r in rows[key]}, key=int))
                        print(f"| {human_size(size)} | {human_time(median)} | {human_time(low)} .. {human_time(high)} "
                              f"| {human_bw(algbw)} | {human_bw(busbw)} | {iters} | {len(rows[key])} |")


if __name__ == "__main__":
    main()
