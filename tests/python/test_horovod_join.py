"""hvd.join() with Horovod's semantics (uneven data), ranks as processes under `cohort run`.

Run through ctest (`ctest --test-dir build -R hvd_join`), or by hand as test_horovod_ops.py says.
"""
import os
import re
import subprocess
import sys

import pytest

from dist_util import HERE
from test_horovod_ops import _env

# HOROVOD_GLOO_TIMEOUT_SECONDS for the case where a rank neither joins nor issues. It is also hvd.init()'s
# deadline for the ranks to meet, so it covers a slow start (3 s was too short for rank 1 to reach rank 0's
# store while rank 0 was still importing torch on the loaded 2-core machine).
TIMEOUT_S = 8


def _run(nproc, *args, timeout_s=None):
    tool = os.environ.get("COHORT_TOOL", "")
    assert tool, "COHORT_TOOL is not set: run these tests through ctest, or set it to build/tools/cohort"
    env = _env()
    if timeout_s is not None:
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(timeout_s)
    proc = subprocess.run([tool, "run", "--nproc-per-node", str(nproc), sys.executable,
                           os.path.join(HERE, "hvd_join_worker.py"), *args],
                          env=env, capture_output=True, text=True, timeout=90)
    return proc, proc.stdout + proc.stderr


@pytest.mark.parametrize("nproc", [2, 3])
def test_joined_ranks_contribute_zeros_to_the_others_allreduces(nproc):
    # Rank 1 joins after 2 steps (rank 2 after 4), rank 0 trains 5 with DistributedOptimizer.
    proc, output = _run(nproc, "uneven")
    assert proc.returncode == 0, output
    lasts = re.findall(r"rank (\d+) JOINED (-?\d+)", proc.stdout)
    assert sorted(int(r) for r, _ in lasts) == list(range(nproc)), output
    assert {int(last) for _, last in lasts} == {0}, output  # rank 0 joined last, and every rank says so


@pytest.mark.parametrize("nproc", [2, 3])
def test_an_op_horovod_refuses_while_a_rank_is_joined_raises_on_every_rank(nproc):
    proc, output = _run(nproc, "refused")
    assert proc.returncode == 0, output
    for rank in (r for r in range(nproc) if r != 1):
        for what in ("Broadcast", "Allgather", "Alltoall"):
            assert f"rank {rank} REFUSED {what}" in proc.stdout, output
    lasts = re.findall(r"rank (\d+) JOINED (-?\d+)", proc.stdout)
    assert len(lasts) == nproc and len({last for _, last in lasts}) == 1, output


@pytest.mark.parametrize("nproc", [2, 3])
def test_operations_in_flight_across_joins_in_many_rounds(nproc):
    proc, output = _run(nproc, "rounds", timeout_s=10)  # a missed operation fails in seconds, not hangs
    assert proc.returncode == 0, output
    assert len(re.findall(r"rank \d+ ROUNDS 30", proc.stdout)) == nproc, output


def test_a_rank_that_neither_joins_nor_issues_is_named(nproc=2):
    proc, output = _run(nproc, "silent", str(TIMEOUT_S), timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, output
    errors = re.findall(r"rank 1 ERROR (.*)", proc.stdout)  # cohort run prefixes each line with its rank
    assert len(errors) == 1, output
    assert errors[0] == (f"hvd.join(): rank 1 joined and waited {TIMEOUT_S} s for operation #0 of rank(s) 0, "
                         "which neither issued it nor joined"), output
