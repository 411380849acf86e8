"""One rank of the CUDA tests (test_cohort_torch_gpu.py), started by `cohort run`: collectives on
CUDA tensors through backend="cohort" (or the form given by --backend) and a DDP step on the GPU,
each checked against values computed here. Prints "OK <checks> <backend>" at the end."""
import argparse
import os
import sys

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401  (registers "cohort")

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="cohort")
args = ap.parse_args()

dist.init_process_group(backend=args.backend)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("COHORT_LOCAL_GPU", os.environ.get("LOCAL_RANK", "0"))))
torch.cuda.set_device(device)
checks = 0


def check(cond, what):
    global checks
    if not cond:
        print(f"rank {rank}: FAILED {what}", file=sys.stderr)
        sys.exit(1)
    checks += 1


n = 1 << 16
t = torch.full((n,), float(rank + 1), device=device)
dist.all_reduce(t)
check(t.is_cuda and torch.all(t == world * (world + 1) / 2).item(), "all_reduce sum")

b = torch.full((n,), float(rank), device=device)
dist.broadcast(b, src=world - 1)
check(torch.all(b == world - 1).item(), "broadcast")

out = torch.empty(n * world, device=device)
dist.all_gather_into_tensor(out, torch.full((n,), float(rank), device=device))
check(all(torch.all(out[r * n:(r + 1) * n] == r).item() for r in range(world)), "all_gather_into_tensor")

# A DDP step: the averaged gradient of a Linear layer whose input differs by rank.
torch.manual_seed(0)
model = torch.nn.Linear(8, 1, bias=False).to(device)
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
x = torch.full((4, 8), float(rank + 1), device=device)
ddp(x).sum().backward()
# d/dw of sum(w . x) over 4 rows = 4 * (rank + 1); averaged over ranks: 4 * (world + 1) / 2.
check(torch.allclose(model.weight.grad, torch.full_like(model.weight.grad, 4 * (world + 1) / 2)), "DDP gradient")

dist.barrier()
print(f"OK {checks} {args.backend}")
dist.destroy_process_group()
