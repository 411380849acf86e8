"""Monitored barriers after a failed one. Barrier 0 (timeout 1 s) fails: rank 1 comes only after
rank 0 has reported it (a key in the store, no sleep); any other rank comes at once. Then three more
barriers (timeout 5 s each) with every rank on time must pass on every rank: the failed barrier must
not leave the ranks' messages out of step. Prints 'B<i> <rank> OK' or 'B<i> <rank> RAISED <s> <message>'."""
import datetime
import os
import time

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
group_timeout = datetime.timedelta(seconds=60)
try:  # torch >= 2.4: a torch built without libuv refuses the default (see dist_util.base_env)
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=group_timeout, use_libuv=False)
except TypeError:  # torch 1.x has no use_libuv
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0, timeout=group_timeout)
dist.init_process_group("cohort", store=store, rank=rank, world_size=world, timeout=group_timeout)
x = torch.ones(4)
dist.all_reduce(x)  # every rank is here: the group works
assert x[0].item() == world


def barrier(i, seconds):
    start = time.monotonic()
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds))
        print(f"B{i} {rank} OK", flush=True)
    except RuntimeError as e:
        print(f"B{i} {rank} RAISED {time.monotonic() - start:.3f} {str(e).splitlines()[0]}", flush=True)


if rank == 1:
    store.wait(["barrier0_failed"], datetime.timedelta(seconds=30))
barrier(0, 1)
if rank == 0:
    store.set("barrier0_failed", "1")
for i in range(1, 4):
    barrier(i, 5)
dist.destroy_process_group()
