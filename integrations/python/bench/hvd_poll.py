"""One rank of the hvd.poll() benchmark (bench/hvd_poll.sh): a small allreduce (15 int8 elements, the
first ones of tests/python/hvd_ops_worker.py) waited for in the two ways Horovod scripts do, alternated
op by op in one job so that both see the same load: `hvd.synchronize(handle)`, and a busy loop
`while not hvd.poll(handle): pass` followed by synchronize. Prints per round the median and worst
milliseconds of each and their ratio; `--simulated-hosts H` splits the ranks over H hosts
(COHORT_HOST_ID), so that they talk TCP between hosts as on the namespace cluster."""
import argparse
import os
import statistics
import time

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--ops", type=int, default=200, help="allreduces per way and round")
parser.add_argument("--simulated-hosts", type=int, default=0)
args = parser.parse_args()
if args.simulated_hosts:
    per_host = int(os.environ["WORLD_SIZE"]) // args.simulated_hosts
    os.environ["COHORT_HOST_ID"] = f"bench-host{int(os.environ['RANK']) // per_host}"

import torch  # noqa: E402  (after COHORT_HOST_ID, which the backend reads when the group is built)

import cohort.horovod.torch as hvd  # noqa: E402

hvd.init()
x = torch.arange(15, dtype=torch.int8).reshape(3, 5) % 3
for round_ in range(1, args.rounds + 1):
    times = {"synchronize": [], "poll": []}
    for _ in range(args.ops):
        for way in ("synchronize", "poll"):
            start = time.perf_counter()
            handle = hvd.allreduce_async(x, op=hvd.Sum)
            if way == "poll":
                while not hvd.poll(handle):
                    pass
            hvd.synchronize(handle)
            times[way].append((time.perf_counter() - start) * 1000)
    med = {w: statistics.median(t) for w, t in times.items()}
    if hvd.rank() == 0:
        print(f"round {round_}: synchronize median {med['synchronize']:.3f} ms worst {max(times['synchronize']):.1f}; "
              f"poll loop median {med['poll']:.3f} ms worst {max(times['poll']):.1f}; "
              f"poll/synchronize {med['poll'] / med['synchronize']:.2f}x", flush=True)
hvd.shutdown()
