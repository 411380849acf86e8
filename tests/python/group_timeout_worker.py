"""Group timeout rank: init_process_group(timeout=3 s); after one good allreduce rank 1 sleeps 8 s
while rank 0 calls the next allreduce, which fails at the group's deadline. The TimeoutError must say
where that deadline came from (init_process_group's timeout, not COHORT_TIMEOUT).
Prints 'RAISED <s> <message>'."""
import datetime
import os
import time

# The group's own timeout is the one under test: COHORT_TIMEOUT would override it.
os.environ.pop("COHORT_TIMEOUT", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cohort_torch  # noqa: E402,F401

rank = int(os.environ["RANK"])
dist.init_process_group("cohort", timeout=datetime.timedelta(seconds=3))
x = torch.ones(16)
dist.all_reduce(x)  # both ranks are here: the group works
assert x[0].item() == dist.get_world_size()
if rank == 1:
    time.sleep(8)
    os._exit(0)  # rank 0 gave up long ago
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(16))
    print("NO ERROR", flush=True)
except RuntimeError as e:
    print(f"RAISED {time.monotonic() - start:.3f} {str(e).splitlines()[0]}", flush=True)
os._exit(0)
