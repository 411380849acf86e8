#!/usr/bin/python3
"""Worker for scripts/bench_slurm.sh: joins a gloo process group from the environment any launcher sets
(MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE: cohort run and torchrun alike), runs one allreduce, and rank 0
prints the wall-clock time at which it completed: the end of "sbatch to the first collective"."""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 0:
    print(f"first collective done at {time.time():.3f}: world size {dist.get_world_size()}, sum {int(t.item())}",
          flush=True)
dist.destroy_process_group()
