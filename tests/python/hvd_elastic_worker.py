"""One rank of an elastic Horovod script (`hvd.elastic.run`, `TorchState`) under `cohort run --max-restarts 1`.

Attempt 0: rank 1 kills itself (SIGKILL) after step 4's update, before committing it; the launcher stops
the job and starts both ranks again. Attempt 1 must resume from the last commit that reached a file (step 3
or 4: rank 0 may have committed step 4 before it was stopped), not from 0, and finish the 6 steps. The
final weights must equal a replay of 6 plain data-parallel steps, which a restart from a wrong or mixed
state would not give. Prints "ELASTIC OK attempt=A resumed=S" on success.
"""
import os
import signal

import torch

import horovod.torch as hvd
from hvd_elastic_common import batch, fresh

STEPS = 6
DIE_AFTER = 4


hvd.init()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model, opt = fresh()
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0)
resumed = []


@hvd.elastic.run
def train(state):
    resumed.append(state.step)
    while state.step < STEPS:
        x, y = batch(state.step, hvd.rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        state.step += 1
        if attempt == 0 and hvd.rank() == 1 and state.step == DIE_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)
        state.commit()


train(state)
assert attempt == 1, f"attempt {attempt} finished: the kill did not happen"
assert resumed[0] in (DIE_AFTER - 1, DIE_AFTER), f"attempt 1 resumed at step {resumed[0]}, not from the last commit"

# The replay: one process, both ranks' batches, their gradients averaged as the allreduce does.
ref, ref_opt = fresh()
for step in range(STEPS):
    ref_opt.zero_grad()
    loss = sum(torch.nn.functional.mse_loss(ref(x), y) for x, y in (batch(step, r) for r in range(hvd.size())))
    (loss / hvd.size()).backward()
    ref_opt.step()
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    assert torch.allclose(p, q, atol=1e-6), f"{name}: {p} after the restart, {q} in the replay"
hvd.shutdown()
print(f"ELASTIC OK attempt={attempt} resumed={resumed[0]}", flush=True)
