"""One rank of the early-exit test, under `cohort run`: every rank runs allreduce #1; then rank 1
returns with exit code 0 while the others go on to allreduce #2, which can never complete."""
import sys

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401  (registers backend "cohort")

dist.init_process_group("cohort")
t = torch.ones(4)
dist.all_reduce(t)
if dist.get_rank() == 1:
    sys.exit(0)
dist.all_reduce(t)
print("allreduce #2 completed without rank 1", flush=True)
