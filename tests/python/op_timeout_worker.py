"""Per-operation timeout rank: rank 0 calls allreduce with its own 300 ms timeout
(AllreduceOptions.timeout) while rank 1 sleeps 5 s before joining; the group's timeout is 60 s.
Rank 0 must raise within ~2 s, naming the operation and its timeout. Prints 'RAISED <s> <message>'."""
import datetime
import os
import time

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401

rank = int(os.environ["RANK"])
dist.init_process_group("cohort", timeout=datetime.timedelta(seconds=60))
x = torch.ones(16)
dist.all_reduce(x)  # both ranks are here: the group works
assert x[0].item() == dist.get_world_size()
if rank == 1:
    time.sleep(5)
    os._exit(0)  # rank 0 gave up long ago; nothing more to do
opts = dist.AllreduceOptions()
opts.timeout = datetime.timedelta(milliseconds=300)
pg = dist.distributed_c10d._get_default_group()
start = time.monotonic()
try:
    pg.allreduce([torch.ones(16)], opts).wait()
    print("NO ERROR", flush=True)
except RuntimeError as e:
    print(f"RAISED {time.monotonic() - start:.3f} {str(e).splitlines()[0]}", flush=True)
os._exit(0)
