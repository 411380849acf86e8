#!/usr/bin/python3
"""Data-parallel training baseline: PyTorch (Debian 1.13) on CPU, Fashion-MNIST, 1 epoch.

bench/peers/ddp_train.py (the same model, data, order and RESULT line) with one addition: --backend {gloo,cohort}
(cohort imports cohort_torch, which registers the backend); RESULT lines name the backend.

Single process (no process group, no DDP):
    /usr/bin/python3 ddp_train.py --model tiny
Two processes, DDP over gloo (env:// on 127.0.0.1):
    GLOO_SOCKET_IFNAME=lo /usr/bin/python3 torchrun311.py --nproc_per_node 2 \
        --master_addr 127.0.0.1 --master_port 29700 ddp_train.py --model tiny

Data: /usr/share/datasets/fashion-mnist/*.gz (MNIST idx format), pixels scaled to [0,1]
(like torchvision ToTensor), no other normalisation. Models:
    tiny: Flatten -> Linear(784,10) -> ReLU            (7,850 parameters)
    mlp:  Flatten -> Linear(784,1024) -> ReLU -> Linear(1024,1024) -> ReLU -> Linear(1024,10)
          (1,863,690 parameters = 7.45 MB of fp32 gradients per step)
CrossEntropyLoss, SGD lr 0.01 (no momentum), batch 32 per rank, DistributedSampler
(shuffle=True, seed 0; with 1 process: num_replicas=1, i.e. a random permutation), 1 epoch.
--loader dataloader: torch.utils.data.DataLoader(TensorDataset, batch_size=32, sampler,
                     num_workers=0) -- the standard idiom (per-sample indexing + collate).
--loader index:      the same sampler's index order, batches cut as x[idx] slices of the
                     in-memory tensors (no per-sample Python work).
torch.set_num_threads(--threads, default 1) in every process.
Timing: (barrier) t0 ... one epoch ... (barrier) t1; samples/s = samples processed by all
ranks / (t1 - t0). Test accuracy on the 10k test set, computed by rank 0 after training.
"""
import argparse
import gzip
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DATA = "/usr/share/datasets/fashion-mnist"


def load_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[0:4], "big")
    ndim = magic & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(split):
    prefix = "train" if split == "train" else "t10k"
    x = load_idx(os.path.join(DATA, f"{prefix}-images-idx3-ubyte.gz"))
    y = load_idx(os.path.join(DATA, f"{prefix}-labels-idx1-ubyte.gz"))
    x = torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)  # N,1,28,28
    y = torch.from_numpy(y.astype(np.int64))
    return x, y


def make_model(name):
    if name == "tiny":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 10), nn.ReLU())
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", "mlp"], default="tiny")
    ap.add_argument("--loader", choices=["dataloader", "index"], default="dataloader")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--tag", default="")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "cohort"])
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ddp = world > 1
    if ddp:
        if args.backend == "cohort":
            import cohort_torch  # noqa: F401  registers backend "cohort"
        dist.init_process_group(args.backend, init_method="env://")
        rank = dist.get_rank()
    else:
        rank = 0

    xtr, ytr = load("train")
    xte, yte = load("test")
    torch.manual_seed(0)
    model = make_model(args.model)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    lossf = nn.CrossEntropyLoss()
    ds = TensorDataset(xtr, ytr)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    if args.loader == "dataloader":
        dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=0)

    samples = 0
    steps = 0
    if ddp:
        dist.barrier()
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if args.loader == "dataloader":
            batches = iter(dl)
        else:
            idx = torch.tensor(list(iter(sampler)), dtype=torch.int64)
            batches = ((xtr[b], ytr[b]) for b in torch.split(idx, args.batch))
        for xb, yb in batches:
            opt.zero_grad(set_to_none=True)
            loss = lossf(model(xb), yb)
            loss.backward()
            opt.step()
            samples += xb.shape[0]
            steps += 1
    if ddp:
        dist.barrier()
    t1 = time.perf_counter()
    total = samples
    if ddp:
        t = torch.tensor([samples], dtype=torch.int64)
        dist.all_reduce(t)
        total = int(t.item())

    if rank == 0:
        net = model.module if ddp else model
        with torch.no_grad():
            pred = net(xte).argmax(1)
            acc = (pred == yte).float().mean().item()
        el = t1 - t0
        print(
            f"RESULT train backend={args.backend} model={args.model} loader={args.loader} procs={world} threads={args.threads} "
            f"batch_per_rank={args.batch} steps_per_rank={steps} samples_total={total} epoch_s={el:.3f} "
            f"samples_per_s={total / el:.1f} step_ms={el / steps * 1e3:.3f} test_acc={acc:.4f} "
            f"final_loss_rank0={loss.item():.4f}{args.tag}",
            flush=True,
        )
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
