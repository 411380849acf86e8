"""Horovod's training API (cohort.horovod.torch: DistributedOptimizer, Compression, SyncBatchNorm,
broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object) on 2 ranks
under `cohort run`, each rank checking against plain torch (hvd_train_worker.py says how).

Run through ctest (label `python`), or by hand:
    COHORT_TOOL=build/tools/cohort PYTHONPATH=build/integrations/python:integrations/python/wheel \
        /usr/bin/python3 -m pytest -q tests/python/test_horovod_train.py
"""
import os
import subprocess
import sys

from dist_util import HERE, base_env


def test_horovod_training_api_matches_torch_on_2_ranks():
    """DistributedOptimizer ends with the weights of one process trained on the whole batch and of
    DDP over gloo (backward_passes_per_step 1 and 2, fp16 compression, Sum, predivide, groups, synchronize +
    skip_synchronize, an unused parameter) and its allreduces complete inside backward; the
    broadcasts and allgather_object deliver the root's / every rank's values; SyncBatchNorm matches
    BatchNorm on the concatenated batch (output, gradients, running statistics)."""
    tool = os.environ.get("COHORT_TOOL", "")
    assert tool, "COHORT_TOOL is not set: run these tests through ctest, or set it to build/tools/cohort"
    env = base_env()
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(k, None)  # the launcher decides
    cmd = [tool, "run", "-n", "2", sys.executable, os.path.join(HERE, "hvd_train_worker.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in (0, 1):
        done = [l for l in proc.stdout.splitlines() if f":{rank}] OK " in l]
        assert done, f"rank {rank} did not finish its checks:\n{output}"
        assert int(done[-1].split()[-1]) > 150, done  # the checks really ran
    assert output.count("overlap: started before backward ended:") == 2, output
