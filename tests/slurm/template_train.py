#!/usr/bin/env python3
# The `train.py` of docs/slurm.md's templates, for tests/slurm/test_templates.sh: each rank records what its
# job gave it (rank, world, host, the CPUs it may run on, Slurm's CPU count for its node, its arguments) as
# results/<world size>.<rank>.json in the folder the job was submitted from, for the test to check.
#
# With --checkpoint-dir (the elastic template), a rank of a world as large as the allocation (every node's
# ranks) holds on until the test fails a node and the launcher stops it for the next generation (at most
# 120 s: then it fails); a rank of a smaller world records and ends, as a job that finished would.
import json
import os
import socket
import sys
import time

world = int(os.environ["WORLD_SIZE"])
rank = int(os.environ["RANK"])
record = {
    "rank": rank,
    "world": world,
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "host": socket.gethostname(),
    "cpus": len(os.sched_getaffinity(0)),
    "slurm_cpus_on_node": os.environ.get("SLURM_CPUS_ON_NODE"),
    "args": sys.argv[1:],
}
os.makedirs("results", exist_ok=True)
path = f"results/{world}.{rank}.json"
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.rename(path + ".tmp", path)  # whole, or not there: the test reads them while the job runs

if "--checkpoint-dir" in sys.argv:
    full = int(os.environ["LOCAL_WORLD_SIZE"]) * int(os.environ["SLURM_JOB_NUM_NODES"])
    deadline = time.monotonic() + 120
    while world == full:
        if time.monotonic() > deadline:
            sys.exit("train.py: no node failed within 120 s")
        time.sleep(0.5)  # until the launcher stops this generation
