#!/usr/bin/python3
"""How much of its communication hvd.DistributedOptimizer hides behind backward (cohort.horovod.torch).

    PYTHONPATH=build/integrations/python:integrations/python/wheel \
        build/tools/cohort run -n 2 /usr/bin/python3 integrations/python/bench/hvd_overlap.py [--steps 40]

The main job's MLP (784 -> 1024 -> 1024 -> 10, 1,863,690 parameters: 7.45 MB of float32 gradients),
32 random samples per rank per step, SGD, 1 thread per rank. Two ways of training, alternated step by
step so that machine noise hits both alike:
  overlapped  hvd.DistributedOptimizer: each gradient's allreduce starts from its hook during
              backward; step() waits for what is left (`exposed`: the communication backward did not hide).
  after       the same allreduces (one per gradient, asynchronous, in backward's order) started only
              once backward has returned, then waited for (`communication`: its whole time).
overlap share = 1 - exposed / communication: the part of the communication that backward hid.
Rank 0 prints one RESULT line per mode with medians (ms per step).
"""
import argparse
import statistics
import time

import torch

import cohort.horovod.torch as hvd


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()

    overlapped_model, after_model = make_model(), make_model()
    overlapped = hvd.DistributedOptimizer(torch.optim.SGD(overlapped_model.parameters(), lr=0.01),
                                          named_parameters=overlapped_model.named_parameters())
    after = torch.optim.SGD(after_model.parameters(), lr=0.01)
    # Backward produces the last layer's gradients first: start the allreduces in that order too.
    after_params = list(reversed(list(after_model.named_parameters())))
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(hvd.rank())
    times = {"overlapped": [], "after": []}

    for step in range(args.warmup + args.steps):
        x = torch.rand(args.batch, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)

        hvd.barrier()
        t0 = time.perf_counter()
        overlapped.zero_grad()
        loss_fn(overlapped_model(x), y).backward()
        t1 = time.perf_counter()
        overlapped.synchronize()
        t2 = time.perf_counter()
        with overlapped.skip_synchronize():
            overlapped.step()
        t3 = time.perf_counter()
        if step >= args.warmup:
            times["overlapped"].append((t1 - t0, t2 - t1, t3 - t0))

        hvd.barrier()
        t0 = time.perf_counter()
        after.zero_grad()
        loss_fn(after_model(x), y).backward()
        t1 = time.perf_counter()
        handles = [hvd.allreduce_async_(p.grad, name=name) for name, p in after_params]
        for handle in handles:
            hvd.synchronize(handle)
        t2 = time.perf_counter()
        after.step()
        t3 = time.perf_counter()
        if step >= args.warmup:
            times["after"].append((t1 - t0, t2 - t1, t3 - t0))

    # The two models saw the same data and the same averaged gradients: they must agree.
    for p, q in zip(overlapped_model.parameters(), after_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    medians = {mode: [1e3 * statistics.median(column) for column in zip(*rows)] for mode, rows in times.items()}
    if hvd.rank() == 0:
        exposed, communication = medians["overlapped"][1], medians["after"][1]
        for mode, (compute, wait, step) in medians.items():
            print(f"RESULT hvd_overlap mode={mode} ranks={hvd.size()} steps={args.steps} batch={args.batch} "
                  f"forward_backward_ms={compute:.2f} wait_after_backward_ms={wait:.2f} step_ms={step:.2f}",
                  flush=True)
        print(f"RESULT hvd_overlap exposed_ms={exposed:.2f} communication_ms={communication:.2f} "
              f"overlap_share={1 - exposed / communication:.2f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
