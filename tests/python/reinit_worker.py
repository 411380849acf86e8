"""One rank of test_cohort_torch.py's re-initialisation tests: cohort process groups of successive
generations created in the same process with destroy_process_group + init_process_group, as an
elastic program does when the world changes (docs/pytorch.md, "Elastic jobs").

    reinit_worker.py generations PORT0 PORT1 PORT2   three generations, same ranks, each its own store
    reinit_worker.py after_failure PORT0 PORT1       generation 0 on 3 ranks; rank 2 dies in it; ranks 0
                                                     and 1 destroy the failed group and go on as a world of 2

Each generation meets at its own MASTER_PORT: torch's env:// makes rank 0 host a fresh TCPStore there,
and reusing the previous generation's port would let a fast rank reach the old store before rank 0
has closed it (torch's rule, for every backend). Prints "OK <rank> <details>" at the end.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401  (registers the backend)


def generation(port, rank, world):
    os.environ.update(MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("cohort")
    assert dist.get_rank() == rank and dist.get_world_size() == world


def main():
    mode, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "generations":
        for gen, port in enumerate(ports):
            generation(port, rank, world)
            t = torch.tensor([float(rank + 1 + gen)])
            dist.all_reduce(t)
            assert t.item() == sum(r + 1 + gen for r in range(world)), (gen, t)
            dist.destroy_process_group()
        print(f"OK {rank} generations={len(ports)}", flush=True)
        return 0
    # after_failure
    generation(ports[0], rank, world)
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 2:
        os.kill(os.getpid(), 9)  # dies between two collectives
    try:
        dist.all_reduce(t)
        print(f"FAIL {rank}: the allreduce after rank 2's death succeeded", flush=True)
        return 1
    except RuntimeError as e:
        error = str(e)
    start = time.monotonic()
    dist.destroy_process_group()
    destroyed = time.monotonic() - start
    generation(ports[1], rank, 2)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0, t
    dist.destroy_process_group()
    named = "lost rank 2" in error or "rank 2" in error
    print(f"OK {rank} destroy_s={destroyed:.3f} named_rank_2={named}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
