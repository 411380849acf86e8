#!/usr/bin/python3
"""What cohort.horovod.torch's Python layer costs per call, over a bare dist.all_reduce, in one job.

DistributedOptimizer starts one allreduce per gradient, hundreds of small ones per step, so the layer's
per-call time matters. Every rank runs, per round and size, each form back to back on the same process
group (the one hvd.init() built), the order rotating between rounds so a noisy stretch of a shared
machine hits all of them:

  dist        dist.all_reduce(t)                                  (the floor: the backend alone)
  hvd_        hvd.allreduce_(t, op=hvd.Sum)                        (in place, blocking)
  hvd_async_  hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum)) (in place, through a handle, as the
                                                                    optimizer's hooks use it)
  dist_new    dist.all_reduce(t.clone(), op=AVG)                   (the same work in torch: a new tensor)
  hvd_avg     hvd.allreduce(t)                                     (Horovod's default: a new tensor, Average)

Per measurement: 20 warm-up calls, then enough calls to last about --min-time (the ranks agree on the
count); the time per call is the slowest rank's. Prints one line per measurement, then per size the
median over rounds of each form and its overhead over `dist` (for hvd_avg, over `dist_new`: a new
tensor each call is one cohort cannot move into shared memory, so it is staged).

  cohort run --nproc-per-node 2 /usr/bin/python3 hvd_overhead.py --sizes 4B,4MiB --rounds 5
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import cohort.horovod.torch as hvd
from sizes import label, parse_size  # beside this script (integrations/python/bench/sizes.py)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4B,4MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per round, size and form")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    forms = {
        "dist": lambda t: dist.all_reduce(t),
        "hvd_": lambda t: hvd.allreduce_(t, op=hvd.Sum),
        "hvd_async_": lambda t: hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum)),
        "dist_new": lambda t: dist.all_reduce(t.clone(), op=dist.ReduceOp.AVG),
        "hvd_avg": lambda t: hvd.allreduce(t),
    }
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    # One tensor per form and size, reused, as gradients are (cohort moves a reused one >= 256 KiB
    # into shared memory at its second allreduce, docs/pytorch.md).
    tensors = {(f, n): torch.zeros(max(n // 4, 1)) for f in forms for n in sizes}

    def agreed_max(value):
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    results = {(f, n): [] for f in forms for n in sizes}
    names = list(forms)
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for n in sizes:
            for f in order:
                t, call = tensors[(f, n)], forms[f]
                start = time.perf_counter()
                for _ in range(20):
                    call(t)
                per_call = (time.perf_counter() - start) / 20
                iters = int(agreed_max(max(20, min(20000, args.min_time / max(per_call, 1e-7)))))
                start = time.perf_counter()
                for _ in range(iters):
                    call(t)
                us = agreed_max((time.perf_counter() - start) / iters * 1e6)
                results[(f, n)].append(us)
                if rank == 0:
                    print(f"round {rnd} {label(n):>7} {f:<10} {us:10.1f} us/call ({iters} calls)", flush=True)
    if rank == 0:
        print(f"\nmedian of {args.rounds} rounds, {world} ranks (torch {torch.__version__}):")
        print(f"{'size':>7} {'form':<10} {'us/call':>10} {'overhead':>10}")
        for n in sizes:
            base = statistics.median(results[("dist", n)])
            for f in names:
                med = statistics.median(results[(f, n)])
                ref = statistics.median(results[("dist_new", n)]) if f == "hvd_avg" else base
                print(f"{label(n):>7} {f:<10} {med:10.1f} {med - ref:+10.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
