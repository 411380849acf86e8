#!/usr/bin/python3
"""Latency of torch.distributed.all_reduce, gloo and cohort side by side in one job, interleaved rounds.

Every rank makes both process groups (the default one with gloo, a second with backend "cohort") and
times the same loop on each in turn: per round and size, the two backends run back to back, the order
alternating between rounds, so that a noisy stretch of a shared machine hits both. One tensor per size
and backend, reused (as DDP reuses its buckets): cohort moves a reused tensor of >= 256 KiB into shared
memory at its second call (docs/pytorch.md, "Tensors reduced again and again").

Per round, size and backend: warm-up (20 calls, which also estimate the time per call), then enough
blocking calls back to back to last about `--min-time` (the ranks agree on the count); the time per call
is the slowest rank's (MAX over ranks, outside the timed loop). Prints one line per
measurement, then the per-round ratios (gloo / cohort: how many times faster cohort is).

  cohort run --nproc-per-node 2 /usr/bin/python3 allreduce_latency.py --sizes 4KiB,1MiB --rounds 5
"""
import argparse
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401  (registers the backend)
from sizes import label, parse_size  # beside this script (integrations/python/bench/sizes.py)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4KiB,1MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per round, size and backend")
    ap.add_argument("--tag", default="", help="printed on every line (e.g. which build)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "cohort": dist.new_group(backend="cohort")}
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    tensors = {(b, n): torch.full((max(n // 4, 1),), float(rank + 1)) for b in groups for n in sizes}

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups["gloo"])
        return t.item()

    # Correctness once per backend and size (sum of rank + 1 over ranks).
    for (b, n), t in tensors.items():
        dist.all_reduce(t, group=groups[b])
        assert bool((t == world * (world + 1) / 2).all()), f"{b} {label(n)}: wrong sum"

    results = {}  # (size, backend) -> [us per call, one per round]
    for r in range(args.rounds):
        order = ["gloo", "cohort"] if r % 2 == 0 else ["cohort", "gloo"]
        for n in sizes:
            for b in order:
                t, g = tensors[(b, n)], groups[b]
                start = time.perf_counter()
                for _ in range(20):
                    dist.all_reduce(t, group=g)
                iters = max(20, math.ceil(args.min_time / max(slowest((time.perf_counter() - start) / 20), 1e-9)))
                iters = int(slowest(iters))  # the same count on every rank
                dist.barrier(group=groups["gloo"])
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(t, group=g)
                us = slowest((time.perf_counter() - start) / iters) * 1e6
                results.setdefault((n, b), []).append(us)
                if rank == 0:
                    print(f"{args.tag} round {r + 1} {label(n)} {b}: {us:.2f} us", flush=True)
    if rank == 0:
        for n in sizes:
            g, c = results[(n, "gloo")], results[(n, "cohort")]
            ratios = " / ".join(f"{x / y:.1f}" for x, y in zip(g, c))
            print(f"{args.tag} {label(n)}: gloo median {statistics.median(g):.2f} us, cohort median "
                  f"{statistics.median(c):.2f} us; gloo/cohort per round {ratios}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
