"""A rank that busy-waits on an operation with the GIL held, as Horovod scripts do
(`while not hvd.poll(handle): pass`), right after letting go of an earlier operation.

Operation A is issued and Python drops its Work and its tensor at once, so the backend holds the
last references to them; operation B is issued behind it, and this thread then spins on
B.is_completed() without ever letting another thread take the GIL (the switch interval is raised
to far beyond the deadline). B completes only if the backend's worker thread goes from A to B
without needing the GIL. It used to free A's Work itself, and freeing a tensor whose Python object
Python dropped first takes the GIL: the worker then waited for this thread's switch interval, and B
for the worker (issue 48: stalls of seconds across hosts). Prints "OK <ms>" or "STUCK <s>".
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401

DEADLINE_S = 5.0

dist.init_process_group("cohort")
n = dist.get_world_size()
warm = torch.ones(4)
dist.all_reduce(warm)  # every rank is here and the group works
assert warm[0].item() == n
sys.setswitchinterval(60.0)  # nothing takes the GIL from this thread while it spins below
first = torch.ones(4)
work_a = dist.all_reduce(first, async_op=True)
second = torch.ones(4)
work_b = dist.all_reduce(second, async_op=True)
del first, work_a  # the backend's references to A are now the last ones
start = time.monotonic()
while not work_b.is_completed():
    if time.monotonic() - start > DEADLINE_S:
        print(f"STUCK {time.monotonic() - start:.1f}", flush=True)
        os._exit(1)  # the worker is stuck behind this thread's GIL: no clean shutdown to wait for
elapsed = time.monotonic() - start
sys.setswitchinterval(0.005)
work_b.wait()
assert second[0].item() == n, second
print(f"OK {elapsed * 1000:.0f}", flush=True)
dist.destroy_process_group()
