#!/usr/bin/python3
"""The PyTorch DDP twin of examples/resnet: the same job in Python, for side-by-side runs.

Same model (ResNet-18 with the CIFAR-style stem, modules created in the same order, so the same seed
gives the same initial weights: --verbose prints their sum in both), same data (Fashion-MNIST's first
--train-samples images, zero-padded to 32x32, scaled to [0,1], normalised with mean 0.2860 and std
0.3530), same sampler (DistributedSampler, shuffle, --seed), batch, optimizer and threads; the same
output lines ("epoch: E, step: S, loss is L" every 10 steps, "samples/s: ...", "test accuracy: ...").

One process (no process group):
    /usr/bin/python3 bench/resnet_twin.py --threads 1 --max-steps 20
Two ranks, DDP over gloo (from the repository root):
    GLOO_SOCKET_IFNAME=lo /usr/bin/python3 bench/peers/torchrun311.py --nproc_per_node 2 \\
        --master_addr 127.0.0.1 --master_port 29600 bench/resnet_twin.py --threads 1 --max-steps 20

Timing as the C++ example: a barrier, the steps, a barrier; samples/s = samples of all ranks over that
time. --zero 1 steps with torch's ZeroRedundancyOptimizer (optimizer state sharded, ZeRO stage 1).
"""
import argparse
import gzip
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

MEAN, STD = 0.2860, 0.3530  # the training set's pixels (28x28): 0.28604, 0.35302


def load_idx(path):
    if not os.path.exists(path):
        raise SystemExit(f"resnet_twin: cannot read {path}: no such file (install dataset-fashion-mnist, or pass --data-dir)")
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = int.from_bytes(raw[0:4], "big") & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_split(data_dir, prefix, limit):
    x = load_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
    y = load_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
    n = min(limit, len(x)) if limit > 0 else len(x)
    x = torch.from_numpy(x[:n].copy()).unsqueeze(1).float().div_(255.0)
    x = F.pad(x, (2, 2, 2, 2), value=0.0).sub_(MEAN).div_(STD)  # Pad(2), ToTensor(), Normalize()
    return x.contiguous(), torch.from_numpy(y[:n].astype(np.int64))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x) if self.shortcut is not None else x
        return F.relu(out)


class ResNet(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        cin = width
        for stage in range(4):
            cout, stride = width << stage, 1 if stage == 0 else 2
            setattr(self, f"layer{stage + 1}", nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.fc = nn.Linear(cin, 10)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        for stage in range(4):
            out = getattr(self, f"layer{stage + 1}")(out)
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


def main():
    ap = argparse.ArgumentParser(description="PyTorch DDP twin of examples/resnet")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.0, help="0: 0.01 for sgd, 0.001 for adam and adamw")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd")
    ap.add_argument("--zero", type=int, choices=[0, 1], default=0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--train-samples", type=int, default=2048)
    ap.add_argument("--test-samples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="0: 1 when ranks share a host")
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: this rank's GPU (LOCAL_RANK), NCCL, DDP even on 1 rank (as the C++ example)")
    args = ap.parse_args()
    lr = args.lr if args.lr > 0 else (0.01 if args.optimizer == "sgd" else 0.001)

    xtr, ytr = load_split(args.data_dir, "train", args.train_samples)
    xte, yte = load_split(args.data_dir, "t10k", args.test_samples)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = args.device == "cuda"
    ddp = world > 1 or cuda
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        xtr, ytr, xte, yte = xtr.to(device), ytr.to(device), xte.to(device), yte.to(device)
    if ddp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    rank = dist.get_rank() if ddp else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = args.threads if args.threads > 0 else (1 if local > 1 else torch.get_num_threads())
    torch.set_num_threads(threads)

    torch.manual_seed(args.seed)
    net = ResNet(args.width)
    initial_sum = sum(p.detach().sum().item() for p in net.parameters())
    net = net.to(device)
    # broadcast_buffers=True, 25 MiB buckets
    model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if cuda else None) if ddp else net
    if args.optimizer == "sgd":
        kind, options = torch.optim.SGD, dict(lr=lr, momentum=args.momentum)
    elif args.optimizer == "adam":
        kind, options = torch.optim.Adam, dict(lr=lr)
    else:
        kind, options = torch.optim.AdamW, dict(lr=lr)
    if args.zero and ddp:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=kind, **options)
    else:
        opt = kind(model.parameters(), **options)
    sampler = DistributedSampler(range(len(xtr)), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)

    if rank == 0 and args.verbose:
        nparams = sum(p.numel() for p in net.parameters())
        nbuffers = sum(b.numel() for b in net.buffers())
        print(f"world {world} ({local} on this host), ResNet-18 width {args.width}: {nparams} parameters "
              f"(initial sum {initial_sum:.9g}), {nbuffers} buffer elements; batch {args.batch} per rank, "
              f"intra-op threads {threads}")
        print(f"oneDNN (MKL-DNN) for convolutions: {'yes' if torch.backends.mkldnn.is_available() else 'no'}; "
              f"optimizer: {type(opt).__name__} {options}")

    samples = steps_run = 0
    stop = False
    if ddp:
        dist.barrier()
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        if stop:
            break
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(iter(sampler)), dtype=torch.int64, device=device)
        batches = torch.split(idx, args.batch)
        for step, b in enumerate(batches):
            xb, yb = xtr.index_select(0, b), ytr.index_select(0, b)
            opt.zero_grad(set_to_none=False)  # C++'s zero_grad zeroes in place
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            samples += len(b)
            steps_run += 1
            if rank == 0 and step % 10 == 0:
                print(f"epoch: {epoch}, step: {step}, loss is {loss.item()}  {step + 1}/{len(batches)}", flush=True)
            if args.max_steps and steps_run == args.max_steps:
                stop = True
                break
    if cuda:
        torch.cuda.synchronize(device)  # the host runs ahead of the GPU: its queued work is part of the run
    if ddp:
        dist.barrier()
    seconds = time.perf_counter() - t0
    total = samples
    if ddp:
        t = torch.tensor([samples], dtype=torch.int64, device=device)
        dist.all_reduce(t)
        total = int(t.item())

    # As the C++ example: rank 0's buffers everywhere, each rank evaluates its share, counts summed.
    if ddp:
        for b in net.buffers():
            dist.broadcast(b, 0)
    net.eval()
    n = len(xte)
    lo, hi = n * rank // world, n * (rank + 1) // world
    correct = 0
    with torch.no_grad():
        for i in range(lo, hi, 200):
            j = min(i + 200, hi)
            correct += int((net(xte[i:j]).argmax(1) == yte[i:j]).sum())
    if ddp:
        t = torch.tensor([correct], dtype=torch.int64, device=device)
        dist.all_reduce(t)
        correct = int(t.item())
    if rank == 0:
        print(f"samples/s: {total / seconds:.1f} ({total} samples on {world} ranks in {seconds:.3f} s, "
              f"{steps_run} steps per rank)")
        print(f"test accuracy: {correct / n:.4f} ({n} test images)", flush=True)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
