"""One rank of an elastic Horovod script under horovodrun's elastic driver (`horovodrun --min-np 1 --max-np 2
--host-discovery-script`), driven by test_horovod_launch.py::test_horovodrun_elastic_adds_and_removes_listed_hosts.

The discovery script first lists localhost alone: one rank trains steps 0-1, commits step 2, and waits to be
stopped (up to a deadline), which the test does by listing 127.0.0.1 too (a second host of this machine).
The next generation has 2 ranks, both resume at step 2 (the new one through sync) and train to step 5, where
they wait for the test to list localhost alone again. The last generation, 1 rank again, resumes at step 5,
trains to step 8 and checks its weights against a replay: steps 0-1 over rank 0's batches, 2-4 over both
ranks', 5-7 over rank 0's. Each rank appends "gen=G size=S rank=R resumed=N" and "waiting ..." lines to
$HVD_PROGRESS, which the test watches. Prints "DISCOVERY ELASTIC OK" at the end.
"""
import os
import sys
import time


import horovod.torch as hvd
from hvd_elastic_common import elastic_state, expect_replayed, train_step

STEPS = 8
GROW_AT = 2    # one rank waits here for the second host
SHRINK_AT = 5  # two ranks wait here for the second host to go
WAIT_LIMIT_S = 60


def progress(line):
    with open(os.environ["HVD_PROGRESS"], "a") as f:
        f.write(line + "\n")


def wait_to_be_stopped(what):
    """The driver ends this generation (SIGTERM to this worker) once the test changed the host list."""
    progress(f"waiting size={hvd.size()} rank={hvd.rank()} step={state.step}")
    deadline = time.monotonic() + WAIT_LIMIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(f"rank {hvd.rank()}: {what} did not happen within {WAIT_LIMIT_S} s (step {state.step})")


hvd.init()
generation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model, opt, state = elastic_state(hvd)
resumed = []


@hvd.elastic.run
def train(state):
    resumed.append(state.step)
    progress(f"gen={generation} size={hvd.size()} rank={hvd.rank()} resumed={state.step}")
    while state.step < STEPS:
        train_step(model, opt, state, hvd.rank())
        state.commit()
        if hvd.size() == 1 and state.step == GROW_AT:
            wait_to_be_stopped("a second host")
        if hvd.size() == 2 and state.step == SHRINK_AT:
            wait_to_be_stopped("the removal of a host")


train(state)
assert hvd.size() == 1 and resumed == [SHRINK_AT], f"generation {generation} of size {hvd.size()} resumed at {resumed}"
expect_replayed(model, STEPS, lambda step: range(2) if GROW_AT <= step < SHRINK_AT else range(1),
                "after the host changes")
hvd.shutdown()
print(f"DISCOVERY ELASTIC OK generation={generation}", flush=True)
