"""Fault test rank: after one good allreduce, the victim rank SIGKILLs itself; every other rank
keeps calling all_reduce and must get a RuntimeError (not a hang) soon after the death.
Survivors print 'RAISED <seconds after the victim's death> <message>'."""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401

victim = int(sys.argv[1])
stamp = sys.argv[2]  # file where the victim writes its time of death
rank = int(os.environ["RANK"])
dist.init_process_group("cohort")
x = torch.ones(1024)
dist.all_reduce(x)
assert x[0].item() == dist.get_world_size()

if rank == victim:
    time.sleep(0.3)
    with open(stamp, "w") as f:
        f.write(repr(time.time()))
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)

try:
    while True:
        dist.all_reduce(torch.ones(1 << 16))
except RuntimeError as e:
    raised_at = time.time()
    for _ in range(100):  # the victim writes before it dies; allow for the file to appear
        if os.path.exists(stamp) and open(stamp).read():
            break
        time.sleep(0.01)
    died_at = float(open(stamp).read())
    msg = str(e).splitlines()[0]
    print(f"RAISED {raised_at - died_at:.3f} {msg}", flush=True)
    os._exit(0)
