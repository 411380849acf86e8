"""One rank under `cohort run`: a cohort process group is destroyed and another made in the same
process (as hvd.shutdown() + hvd.init() or a rebuild after an error do), each on its own prefix of the
job's store, and their first operations differ (an allgather, then an allreduce). Each group's
communicator must be a communicator of its own for the flight recorder, or the launcher compares the
second group's operation #1 with the first's and reports a mismatch that never happened.
Prints "OK <rank>"."""
import datetime
import os

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401  (registers the backend)

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                      timeout=datetime.timedelta(seconds=30))
for generation, op in enumerate(("allgather", "allreduce")):
    dist.init_process_group("cohort", store=dist.PrefixStore(f"regroup/{generation}", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    if op == "allgather":
        parts = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(parts, torch.full((3,), rank, dtype=torch.int64))
        assert [int(p[0]) for p in parts] == list(range(world)), parts
    else:
        x = torch.ones(4)
        dist.all_reduce(x)
        assert x[0].item() == world, x
    dist.destroy_process_group()
print(f"OK {rank}", flush=True)
