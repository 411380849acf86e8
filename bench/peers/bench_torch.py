#!/usr/bin/python3
"""Collective benchmark for torch.distributed (backend gloo, CPU) in the style of nccl-tests: the PyTorch peer.

Launch with torchrun (here through torchrun311.py, see its header), for example 2 ranks:
    GLOO_SOCKET_IFNAME=lo /usr/bin/python3 torchrun311.py --nproc_per_node 2 \\
        --master_addr 127.0.0.1 --master_port 29511 bench_torch.py --op allreduce --sizes 8,1M

Method, the same as bench_mpi.c's (see there), per size in bytes of fp32 data: one correctness check,
the buffer zeroed; warm-up of 5 ops then about 0.2 s more; iterations per trial: the smallest count
lasting --min-time (at least 2); --trials trials after a barrier, a trial's time per op the slowest
rank's. Counts the ranks must agree on are maxima over ranks. Every op works on buffers allocated once
(allreduce and broadcast in place; allgather into a preallocated list, bytes = the gathered total;
alltoall all_to_all_single between two buffers, bytes = one rank's input, as bench_mpi.c's).
Rank 0 prints one `RESULT peer=torch-gloo...` line per size, fields as bench_mpi.c.
"""
import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist

DEFAULT_SIZES = "8,1024,64K,1M,4M,16M,64M,256M"
UNITS = {"KIB": 1 << 10, "MIB": 1 << 20, "K": 1 << 10, "M": 1 << 20, "B": 1}


def parse_size(text):
    """'8' -> 8, '64K' / '64KiB' -> 65536, '1M' -> 1048576."""
    text = text.strip().upper()
    for suffix, unit in UNITS.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * unit
    return int(text)


def max_over_ranks(x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def prepare(op, nbytes, rank, n):
    """Buffers for one size: checks the op once on known values, zeroes them, returns (run, bytes, busbw factor)."""
    if op == "allgather":
        part = max(nbytes // n // 4, 1)
        mine = torch.full((part,), float(rank + 1))
        gathered = [torch.zeros(part) for _ in range(n)]
        dist.all_gather(gathered, mine)
        assert all(bool((g == r + 1).all()) for r, g in enumerate(gathered)), "allgather gave a wrong result"
        mine.zero_()
        return (lambda: dist.all_gather(gathered, mine)), part * 4 * n, (n - 1) / n
    if op == "alltoall":
        block = max(nbytes // 4 // n, 1)
        src = torch.arange(block * n, dtype=torch.float32) + rank * block * n  # block j goes to rank j
        dst = torch.zeros(block * n)
        dist.all_to_all_single(dst, src)
        want = torch.cat([torch.arange(block, dtype=torch.float32) + r * block * n + rank * block for r in range(n)])
        assert bool((dst == want).all()), "alltoall gave a wrong result"
        dst.zero_()
        return (lambda: dist.all_to_all_single(dst, src)), block * n * 4, (n - 1) / n
    count = max(nbytes // 4, 1)
    if op == "allreduce":
        buf = torch.full((count,), float(rank + 1))
        dist.all_reduce(buf)
        assert bool((buf == n * (n + 1) / 2).all()), "allreduce gave a wrong result"
        buf.zero_()
        return (lambda: dist.all_reduce(buf)), count * 4, 2 * (n - 1) / n
    buf = torch.full((count,), float(rank + 7))
    dist.broadcast(buf, src=0)
    assert bool((buf == 7).all()), "broadcast gave a wrong result"
    buf.zero_()
    return (lambda: dist.broadcast(buf, src=0)), count * 4, 1.0


def seconds_per_op(run, iters):
    """Runs `iters` ops back to back after a barrier; the slowest rank's time per op."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    return max_over_ranks((time.perf_counter() - start) / iters)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", default="allreduce", choices=["allreduce", "broadcast", "allgather", "alltoall"])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated, e.g. 8,64K,1M")
    parser.add_argument("--min-time", type=float, default=0.5)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--tag", default="", help="appended to the peer name")
    args = parser.parse_args()

    dist.init_process_group("gloo", init_method="env://")
    rank, n = dist.get_rank(), dist.get_world_size()
    for nbytes in map(parse_size, args.sizes.split(",")):
        run, total_bytes, bus_factor = prepare(args.op, nbytes, rank, n)
        per_op = seconds_per_op(run, 5)
        per_op = seconds_per_op(run, int(max_over_ranks(math.ceil(0.2 / max(per_op, 1e-9)))))
        iters = int(max_over_ranks(max(2, math.ceil(args.min_time / max(per_op, 1e-9)))))
        times = [seconds_per_op(run, iters) for _ in range(args.trials)]
        median = statistics.median(times)
        algbw = total_bytes / median / 1e9
        if rank == 0:
            print(f"RESULT peer=torch-gloo{args.tag} op={args.op} n={n} bytes={total_bytes} iters={iters} "
                  f"trials={args.trials} time_us_median={median * 1e6:.2f} time_us_min={min(times) * 1e6:.2f} "
                  f"time_us_max={max(times) * 1e6:.2f} algbw_GBps={algbw:.4f} busbw_GBps={algbw * bus_factor:.4f}",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
