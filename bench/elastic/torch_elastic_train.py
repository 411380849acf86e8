#!/usr/bin/python3
"""The peer of cohort's elastic Fashion-MNIST job: PyTorch DDP (gloo, CPU) under torchrun's elastic
agent, written after PyTorch's tutorial "Fault-tolerant Distributed Training with torchrun": every
process loads the snapshot when there is one, trains, and rank 0 writes a snapshot every
--snapshot-every steps (the tutorial writes one per epoch; here as often as cohort's job checkpoints).

    torchrun --nnodes 2:4 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint h0:29500 \
        --max_restarts 3 torch_elastic_train.py --snapshot /shared/snapshot.pt

The model, data and arithmetic are the main job's: MLP 784-1024-1024-10, SGD, batch 32 per rank,
torch's DistributedSampler (seed 0). A resumed run continues at the snapshot's epoch and step (with
the new world size the sampler splits the epoch anew, as the tutorial's code would). On a restart
(TORCHELASTIC_RESTART_COUNT > 0) rank 0 prints "restart N: first step done at T (unix time)", the same
line cohort's example prints, so bench/elastic/side_by_side.sh measures both the same way.
"""
import argparse
import gzip
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DistributedSampler

DATA = "/usr/share/datasets/fashion-mnist"


def load_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = int.from_bytes(raw[0:4], "big") & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(prefix, limit=0):
    x = load_idx(os.path.join(DATA, f"{prefix}-images-idx3-ubyte.gz"))
    y = load_idx(os.path.join(DATA, f"{prefix}-labels-idx1-ubyte.gz"))
    if limit:
        x, y = x[:limit], y[:limit]
    return torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1), torch.from_numpy(y.astype(np.int64))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--snapshot", required=True)
    ap.add_argument("--snapshot-every", type=int, default=25)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--train-samples", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    xtr, ytr = load("train", args.train_samples)
    xte, yte = load("t10k")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    epoch0, step0 = 0, 0
    if os.path.exists(args.snapshot):  # the tutorial's _load_snapshot
        snap = torch.load(args.snapshot)
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        epoch0, step0 = snap["epoch"], snap["step"]
        if rank == 0:
            print(f"resuming from {args.snapshot} at epoch {epoch0}, step {step0} (world {world})", flush=True)
    ddp = nn.parallel.DistributedDataParallel(model)
    lossf = nn.CrossEntropyLoss()
    sampler = DistributedSampler(range(len(xtr)), num_replicas=world, rank=rank, shuffle=True, seed=0)
    first = True
    for epoch in range(epoch0, args.epochs):
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(iter(sampler)), dtype=torch.int64)
        batches = torch.split(idx, args.batch)
        for step in range(step0 if epoch == epoch0 else 0, len(batches)):
            b = batches[step]
            opt.zero_grad(set_to_none=True)
            loss = lossf(ddp(xtr[b]), ytr[b])
            loss.backward()
            opt.step()
            if first and restart > 0 and rank == 0:
                print(f"restart {restart}: first step done at {time.time():.3f} (unix time), world size {world}",
                      flush=True)
            first = False
            if rank == 0 and step % 10 == 0:
                print(f"epoch: {epoch}, step: {step}, loss is {loss.item():.4f}", flush=True)
            if rank == 0 and (step + 1) % args.snapshot_every == 0:  # the tutorial's _save_snapshot
                nxt = (epoch, step + 1) if step + 1 < len(batches) else (epoch + 1, 0)
                tmp = args.snapshot + ".tmp"
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": nxt[0],
                            "step": nxt[1]}, tmp)
                os.replace(tmp, args.snapshot)
    if rank == 0:
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        print(f"test accuracy: {acc:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
