"""One rank of an elastic Horovod script in cohort's elastic job (`cohort run --nnodes 1:2`, one rank per node).

Generation 0 has 2 nodes (COHORT_HOST_ID a and b, two agents on this machine standing for two hosts). After
committing step 3, node b is lost: its rank kills its agent and then itself (SIGKILL both). The survivor's agent
starts generation 1 alone; its worker, a new process, must resume from its last commit (step 3, or step 2
when its agent stopped it before it committed step 3), not from 0, and end with the weights of a replay: the steps before the resume
averaged over both nodes' batches, the rest over its own. Prints "NODE ELASTIC OK generation=G resumed=S".
"""
import os
import signal


import horovod.torch as hvd
from hvd_elastic_common import elastic_state, expect_replayed, train_step

STEPS = 6
LOSE_B_AFTER = 3


hvd.init()
generation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
host = os.environ["COHORT_HOST_ID"]
assert generation > 0 or hvd.size() == 2, f"generation 0 has {hvd.size()} node(s): both agents must meet first"
model, opt, state = elastic_state(hvd)
resumed = []


@hvd.elastic.run
def train(state):
    resumed.append(state.step)
    while state.step < STEPS:
        train_step(model, opt, state, hvd.rank())
        state.commit()
        if generation == 0 and host == "b" and state.step == LOSE_B_AFTER:
            agent = os.getppid()
            with open(f"/proc/{agent}/comm") as f:
                assert f.read().strip() == "cohort", "the worker's parent is not its cohort agent"
            os.kill(agent, signal.SIGKILL)  # the node is lost: its agent and its worker
            os.kill(os.getpid(), signal.SIGKILL)


train(state)
assert generation >= 1 and hvd.size() == 1, f"generation {generation} of {hvd.size()} finished: node b was not lost"
start = resumed[0]
# a committed step 2 before it joined step 3's allreduce, which b's commit of step 3 needed; whether it
# committed step 3 too depends on how soon its agent stopped it once b was gone.
assert start in (LOSE_B_AFTER - 1, LOSE_B_AFTER), f"generation {generation} resumed at step {start}"

expect_replayed(model, STEPS, lambda step: range(2) if step < start else range(1), "after the lost node")
hvd.shutdown()
print(f"NODE ELASTIC OK generation={generation} resumed={start}", flush=True)
