#!/usr/bin/python3
"""Synthetic training speed: Horovod's API on cohort against PyTorch DDP, the same model and data.

    export PYTHONPATH=build/integrations/python GLOO_SOCKET_IFNAME=lo
    build/tools/cohort run -n 2 /usr/bin/python3 integrations/python/bench/hvd_synthetic.py --mode hvd
    build/tools/cohort run -n 2 /usr/bin/python3 integrations/python/bench/hvd_synthetic.py --mode ddp-gloo

What Horovod's pytorch_synthetic_benchmark measures, written here for cohort's bench (bench/hvd_side_by_side.sh
runs the modes interleaved): a torchvision model (default resnet18, with plain BatchNorm in every mode so that
the modes compute the same thing; Horovod's own benchmark passes hvd.SyncBatchNorm) on one fixed random batch
per rank, SGD, forward + backward + step timed over `--iters` iterations of `--batches-per-iter`
steps after `--warmup` steps. Modes:
  hvd        import horovod.torch as hvd (cohort's, unless a real Horovod is installed); hvd.DistributedOptimizer
             and hvd.broadcast_parameters, as Horovod's benchmark does
  ddp-gloo   torch.distributed with gloo and torch.nn.parallel.DistributedDataParallel (the peer)
  ddp-cohort the same DDP over cohort's backend (import cohort_torch; backend "cohort")
Rank 0 prints each iteration's img/s over all ranks and one RESULT line with the mean.
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torchvision import models


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["hvd", "ddp-gloo", "ddp-cohort"], required=True)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batches-per-iter", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = getattr(models, args.model)()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.mode == "hvd":
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        barrier = hvd.barrier
    else:
        import torch.distributed as dist
        if args.mode == "ddp-cohort":
            import cohort_torch  # noqa: F401  registers backend "cohort"
        dist.init_process_group(backend="gloo" if args.mode == "ddp-gloo" else "cohort")
        rank, size = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
        barrier = dist.barrier

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))

    def step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    rates = []
    for i in range(args.iters):
        barrier()
        t0 = time.perf_counter()
        for _ in range(args.batches_per_iter):
            step()
        barrier()
        rate = size * args.batch_size * args.batches_per_iter / (time.perf_counter() - t0)
        rates.append(rate)
        if rank == 0:
            print(f"iter {i}: {rate:.2f} img/s on {size} ranks", flush=True)
    if rank == 0:
        print(f"RESULT mode={args.mode} model={args.model} batch={args.batch_size} ranks={size} "
              f"img_per_s={sum(rates) / len(rates):.2f} iters={','.join(f'{r:.2f}' for r in rates)}", flush=True)


if __name__ == "__main__":
    main()
