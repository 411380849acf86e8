"""A plain DDP training script in the style users already have (LOCAL_RANK from the
environment, DistributedSampler, DistributedDataParallel, init_process_group from env://).
The only cohort-specific line is the import that registers the backend, as with torch_accl.

    torchrun311.py --nproc_per_node 2 ddp_script.py --backend cohort --out w.pt
    cohort run --nproc-per-node 2 python3 ddp_script.py --backend cohort --out w.pt

Synthetic, seeded data (a fixed linear teacher) so runs are deterministic and quick; rank 0
saves the final state_dict to --out.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="cohort")
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=2048)
args = parser.parse_args()

if args.backend == "cohort":
    import cohort_torch  # noqa: F401  registers backend "cohort"

local_rank = int(os.environ["LOCAL_RANK"])
torch.set_num_threads(1)
dist.init_process_group(backend=args.backend)

g = torch.Generator().manual_seed(1234)
x = torch.randn(args.samples, 32, generator=g)
teacher = torch.randn(32, 4, generator=g)
y = (x @ teacher).argmax(dim=1)
dataset = TensorDataset(x, y)
sampler = DistributedSampler(dataset, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_size=32, sampler=sampler)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        opt.zero_grad()
        loss = loss_fn(ddp(xb), yb)
        loss.backward()
        opt.step()
    if dist.get_rank() == 0:
        print(f"epoch {epoch} loss {loss.item():.4f} (local_rank {local_rank})", flush=True)

if dist.get_rank() == 0:
    torch.save(model.state_dict(), args.out)
dist.barrier()
dist.destroy_process_group()
