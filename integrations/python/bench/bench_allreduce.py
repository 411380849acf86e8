#!/usr/bin/python3
"""nccl-tests-style collective benchmark for torch.distributed, backend gloo or cohort (CPU).

bench/peers/bench_torch.py's method and RESULT lines (the peers' method, unchanged) with one addition:
--backend {gloo,cohort} (cohort imports cohort_torch, which registers the backend).

Launch (example, n=2):
  GLOO_SOCKET_IFNAME=lo /usr/bin/python3 -m torch.distributed.run --nproc_per_node 2 \
      --master_addr 127.0.0.1 --master_port 29511 bench_torch.py --op allreduce

Method, per message size (bytes of fp32 data):
  * correctness check once (values rank+1, expect the right sum / gathered values);
  * warm-up: 5 ops, then ~0.2 s more (counts agreed across ranks);
  * iteration count: the smallest count whose estimated time is >= --min-time (0.5 s),
    at least 2; the ranks agree on the max of their estimates;
  * --trials (5) timed trials: barrier, then `iters` blocking ops back to back; per-rank
    time/iters, max over ranks (all-reduce MAX, outside the timed region) = time per op;
  * prints median/min/max over the trials, algbw = bytes/time, busbw as nccl-tests:
      allreduce busbw = algbw*2(n-1)/n ; broadcast busbw = algbw ;
      allgather busbw = algbw*(n-1)/n with bytes = TOTAL gathered size (nccl-tests convention,
      each rank contributes bytes/n).
All ops are in place on a pre-allocated buffer of zeros (allgather: pre-allocated output list).
"""
import argparse
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

SIZES = [8, 1024, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def parse_size(s):
    s = s.strip().upper()
    mult = 1
    for suf, m in (("KIB", 1 << 10), ("MIB", 1 << 20), ("K", 1 << 10), ("M", 1 << 20), ("B", 1)):
        if s.endswith(suf):
            mult = m
            s = s[: -len(suf)]
            break
    return int(s) * mult


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="allreduce", choices=["allreduce", "broadcast", "allgather"])
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--tag", default="")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "cohort"])
    args = ap.parse_args()

    if args.backend == "cohort":
        import cohort_torch  # noqa: F401  registers backend "cohort"
    dist.init_process_group(args.backend, init_method="env://")
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    def maxall(x):
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    for nbytes in sizes:
        if args.op == "allgather":
            per = max(nbytes // n // 4, 1)
            buf = torch.zeros(per, dtype=torch.float32)
            outs = [torch.zeros(per, dtype=torch.float32) for _ in range(n)]
            total_bytes = per * 4 * n
            # correctness
            buf.fill_(rank + 1)
            dist.all_gather(outs, buf)
            assert all(bool((o == i + 1).all()) for i, o in enumerate(outs)), "allgather wrong"
            buf.zero_()
            op = lambda: dist.all_gather(outs, buf)
        else:
            count = max(nbytes // 4, 1)
            buf = torch.zeros(count, dtype=torch.float32)
            total_bytes = count * 4
            if args.op == "allreduce":
                buf.fill_(rank + 1)
                dist.all_reduce(buf)
                assert bool((buf == n * (n + 1) / 2).all()), "allreduce wrong"
                buf.zero_()
                op = lambda: dist.all_reduce(buf)
            else:
                buf.fill_(rank + 7)
                dist.broadcast(buf, src=0)
                assert bool((buf == 7).all()), "broadcast wrong"
                buf.zero_()
                op = lambda: dist.broadcast(buf, src=0)

        # warm-up: 5 ops, then ~0.2 s more. Counts are agreed via MAX so that every rank
        # issues the same number of collectives.
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            op()
        per_op = maxall((time.perf_counter() - t0) / 5)
        k = int(maxall(math.ceil(0.2 / max(per_op, 1e-9))))
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            op()
        # calibrate: time of one op from the second warm-up phase
        per_op = maxall((time.perf_counter() - t0) / k)
        iters = max(2, math.ceil(args.min_time / max(per_op, 1e-9)))
        iters = int(maxall(iters))

        times = []
        for _ in range(args.trials):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                op()
            dt = (time.perf_counter() - t0) / iters
            times.append(maxall(dt))
        med = statistics.median(times)
        algbw = total_bytes / med / 1e9
        if args.op == "allreduce":
            busbw = algbw * 2 * (n - 1) / n
        elif args.op == "allgather":
            busbw = algbw * (n - 1) / n
        else:
            busbw = algbw
        if rank == 0:
            print(
                f"RESULT peer=torch-{args.backend}{args.tag} op={args.op} n={n} bytes={total_bytes} iters={iters} "
                f"trials={args.trials} time_us_median={med*1e6:.2f} time_us_min={min(times)*1e6:.2f} "
                f"time_us_max={max(times)*1e6:.2f} algbw_GBps={algbw:.4f} busbw_GBps={busbw:.4f}",
                flush=True,
            )
        del buf
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
