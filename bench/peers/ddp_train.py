#!/usr/bin/python3
"""The PyTorch training peer: one epoch of Fashion-MNIST on CPU, alone or with DistributedDataParallel over gloo.

One process (no process group, no DDP):
    /usr/bin/python3 ddp_train.py --model tiny
Two processes, DDP over gloo:
    GLOO_SOCKET_IFNAME=lo /usr/bin/python3 torchrun311.py --nproc_per_node 2 \\
        --master_addr 127.0.0.1 --master_port 29700 ddp_train.py --model tiny

Data: Debian's Fashion-MNIST files (/usr/share/datasets/fashion-mnist/*-ubyte.gz, or --data), pixels
scaled to [0, 1], nothing else. Models:
    tiny  Flatten -> Linear(784, 10) -> ReLU              7,850 parameters (the example's "seed" model)
    mlp   Flatten -> Linear(784, 1024) -> ReLU -> Linear(1024, 1024) -> ReLU -> Linear(1024, 10)
          1,863,690 parameters: 7.45 MB of fp32 gradients each step
Cross-entropy loss, SGD with lr 0.01 and no momentum, batch 32 per rank, weights from torch.manual_seed(0),
order from DistributedSampler(shuffle=True, seed=0) (one process: a random permutation), 1 epoch.
    --loader dataloader  torch's DataLoader over a TensorDataset (per-sample indexing and collation)
    --loader index       the same sampler's order, batches cut as x[indices] from the in-memory tensors
torch.set_num_threads(--threads) in every process (default 1).
Timing: a barrier, the epoch, a barrier; samples/s = samples of all ranks / that time. Rank 0 then computes
the accuracy on the 10,000 test images and prints one `RESULT train ...` line.
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


def read_idx(path):
    """An MNIST idx file (gzip) as a numpy array of uint8."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data, split):
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(data, f"{prefix}-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(data, f"{prefix}-labels-idx1-ubyte.gz"))
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)  # N x 1 x 28 x 28
    return x, torch.from_numpy(labels.astype(np.int64))


def make_model(name):
    if name == "tiny":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 10), nn.ReLU())
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["tiny", "mlp"], default="tiny")
    parser.add_argument("--loader", choices=["dataloader", "index"], default="dataloader")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--limit", type=int, default=0, help="train on the first N images only (a quick check)")
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--tag", default="", help="appended to the RESULT line")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ddp = world > 1
    if ddp:
        dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank() if ddp else 0

    x_train, y_train = load(args.data, "train")
    x_test, y_test = load(args.data, "test")
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]
    torch.manual_seed(0)
    model = make_model(args.model)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    dataset = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=0)

    samples = steps = 0
    if ddp:
        dist.barrier()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if args.loader == "dataloader":
            batches = iter(loader)
        else:
            order = torch.tensor(list(iter(sampler)), dtype=torch.int64)
            batches = ((x_train[b], y_train[b]) for b in torch.split(order, args.batch))
        for xb, yb in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            samples += xb.shape[0]
            steps += 1
    if ddp:
        dist.barrier()
    elapsed = time.perf_counter() - start
    total = samples
    if ddp:
        count = torch.tensor([samples], dtype=torch.int64)
        dist.all_reduce(count)
        total = int(count.item())

    if rank == 0:
        net = model.module if ddp else model
        with torch.no_grad():
            accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
        print(f"RESULT train model={args.model} loader={args.loader} procs={world} threads={args.threads} "
              f"batch_per_rank={args.batch} steps_per_rank={steps} samples_total={total} epoch_s={elapsed:.3f} "
              f"samples_per_s={total / elapsed:.1f} step_ms={elapsed / steps * 1e3:.3f} test_acc={accuracy:.4f} "
              f"final_loss_rank0={loss.item():.4f}{args.tag}", flush=True)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
