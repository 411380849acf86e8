"""cohort.horovod.torch's collectives (Horovod's PyTorch API over cohort) under real processes.

Run through ctest (label `python`), or by hand:
    COHORT_TORCH_MODULE_DIR=build/integrations/python COHORT_TOOL=build/tools/cohort \
        PYTHONPATH=build/integrations/python:integrations/python/wheel /usr/bin/python3 -m pytest -q \
        tests/python/test_horovod_ops.py
"""
import os
import subprocess
import sys

from dist_util import HERE, SOURCE_DIR, base_env

# The package's sources: the build tree runs them in place (the wheel and `cmake --install` ship them).
PACKAGE_DIR = os.path.join(SOURCE_DIR, "integrations", "python", "wheel")


def _env():
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_DIR, env["PYTHONPATH"]])
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)  # the launcher decides
    return env


def test_every_horovod_collective_matches_torch_on_every_rank():
    # 3 ranks, so that a process set ({0, 2}) leaves a rank out and splits differ between ranks.
    tool = os.environ.get("COHORT_TOOL", "")
    assert tool, "COHORT_TOOL is not set: run these tests through ctest, or set it to build/tools/cohort"
    proc = subprocess.run([tool, "run", "--nproc-per-node", "3", sys.executable,
                           os.path.join(HERE, "hvd_ops_worker.py")],
                          env=_env(), capture_output=True, text=True, timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    oks = [l for l in proc.stdout.splitlines() if " OK " in l or l.startswith("OK ")]
    assert len(oks) == 3, output
    assert all(int(l.split("OK ")[1]) > 400 for l in oks), output  # the checks really ran


def test_a_script_started_without_a_launcher_is_a_world_of_one():
    # Horovod's rule: `python3 train.py` alone is rank 0 of 1, and every collective is the identity;
    # then the same beside a default group the script built itself.
    script = """
import torch, cohort.horovod.torch as hvd
hvd.init()
assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(), hvd.cross_size()) == (1, 0, 1, 0, 1)
x = torch.arange(4.0)
assert torch.equal(hvd.allreduce(x), x) and torch.equal(hvd.allgather(x), x)
assert torch.equal(hvd.broadcast(x, 0), x) and torch.equal(hvd.alltoall(x), x)
assert hvd.join() == 0
hvd.shutdown()
# A script that built torch's default group itself (here gloo): hvd builds a cohort group beside it,
# and shutdown() leaves the script's group alone.
import torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
hvd.init()
assert dist.get_backend(hvd.mpi_ops._state.world_group) == "cohort"
assert torch.equal(hvd.allreduce(x, op=hvd.Sum), x) and hvd.join() == 0
hvd.shutdown()
assert dist.is_initialized() and dist.get_backend() == "gloo"
print("ALONE OK")
"""
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "ALONE OK" in proc.stdout, proc.stdout + proc.stderr
