"""One rank of an elastic Horovod script (`hvd.elastic.run`, `TorchState`) under `cohort run --max-restarts 1`.

Attempt 0: rank 1 kills itself (SIGKILL) after step 4's update, before committing it; the launcher stops
the job and starts both ranks again. Attempt 1 must resume from the last commit that reached a file (step 3
or 4: rank 0 may have committed step 4 before it was stopped), not from 0, and finish the 6 steps. The
final weights must equal a replay of 6 plain data-parallel steps, which a restart from a wrong or mixed
state would not give. Prints "ELASTIC OK attempt=A resumed=S" on success.
"""
import os
import signal


import horovod.torch as hvd
from hvd_elastic_common import elastic_state, expect_replayed, train_step

STEPS = 6
DIE_AFTER = 4


hvd.init()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model, opt, state = elastic_state(hvd)
resumed = []


@hvd.elastic.run
def train(state):
    resumed.append(state.step)
    while state.step < STEPS:
        train_step(model, opt, state, hvd.rank())
        if attempt == 0 and hvd.rank() == 1 and state.step == DIE_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)
        state.commit()


train(state)
assert attempt == 1, f"attempt {attempt} finished: the kill did not happen"
assert resumed[0] in (DIE_AFTER - 1, DIE_AFTER), f"attempt 1 resumed at step {resumed[0]}, not from the last commit"

# The replay: one process, both ranks' batches, their gradients averaged as the allreduce does.
expect_replayed(model, STEPS, lambda step: range(hvd.size()), "after the restart")
hvd.shutdown()
print(f"ELASTIC OK attempt={attempt} resumed={resumed[0]}", flush=True)
