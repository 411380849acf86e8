"""cohort_torch (the torch.distributed backend) against gloo, under real processes.

Run through ctest (label `python`), or by hand:
    COHORT_TORCH_MODULE_DIR=build/integrations/python COHORT_TOOL=build/tools/cohort \
        PYTHONPATH=build/integrations/python /usr/bin/python3 -m pytest -q tests/python
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from dist_util import HERE, TORCHRUN311, base_env, describe, free_port, run_ranks

WORLD = 2


def test_import_registers_backend():
    import torch.distributed as dist

    import cohort_torch

    assert cohort_torch.BACKEND_NAME == "cohort"
    assert dist.Backend("cohort") == "cohort"
    assert "COHORT" in dist.Backend._plugins
    import importlib
    importlib.reload(cohort_torch)  # a second import must not register twice


@pytest.mark.parametrize("init", ["env", "store"])
def test_every_operation_matches_gloo(init):
    results = run_ranks([os.path.join(HERE, "ops_worker.py"), "--init", init], WORLD, timeout=60)
    assert all(rc == 0 for rc, _, _ in results), describe(results)
    for rc, out, _ in results:
        assert out.strip().splitlines()[-1].startswith("OK "), out
        assert int(out.strip().splitlines()[-1].split()[1]) > 100  # the checks really ran


def _torchrun_refuses_this_torch():
    """torch >= 2.4's torchrun creates its rendezvous TCPStore with libuv whatever USE_LIBUV says;
    a torch built without libuv (Debian 13's 2.6) then cannot run torchrun at all. None if it can."""
    import torch.distributed as dist
    try:
        dist.TCPStore("127.0.0.1", 0, 1, True, use_libuv=True)
    except TypeError:
        return None  # torch 1.x: no libuv option
    except RuntimeError as e:
        if "libuv" in str(e):
            return str(e)
    return None


def _torchrun(backend, out_path, timeout=60):
    refused = _torchrun_refuses_this_torch()
    if refused:
        pytest.skip(f"torchrun cannot start with this torch {torch.__version__}: {refused}; "
                    "`cohort run` is tested below")
    if int(torch.__version__.split(".")[0]) >= 2:
        # torch's own torchrun. Its c10d rendezvous, unlike the default static one, honours USE_LIBUV
        # (Debian 13's torch 2.6 has no libuv, and the static rendezvous would insist on it).
        launcher = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    else:
        # Debian 12's torchrun (torch 1.13 on Python 3.11) dies before starting workers.
        if not os.path.exists(TORCHRUN311):
            pytest.skip(f"{TORCHRUN311} not present (shared/ is beside the clone in CI)")
        launcher = [sys.executable, TORCHRUN311, "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd = launcher + ["--nproc_per_node", str(WORLD), "--monitor_interval", "0.1",
                      os.path.join(HERE, "ddp_script.py"), "--backend", backend, "--out", out_path]
    return subprocess.run(cmd, env=base_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gloo_weights(tmp_path_factory):
    # The reference run: the same script with gloo, its ranks started here (env://), so that it
    # depends on neither launcher under test.
    path = str(tmp_path_factory.mktemp("gloo") / "gloo.pt")
    results = run_ranks([os.path.join(HERE, "ddp_script.py"), "--backend", "gloo", "--out", path], WORLD)
    assert all(rc == 0 for rc, _, _ in results), describe(results)
    return torch.load(path)


def _assert_weights_match(path, reference):
    got = torch.load(path)
    assert got.keys() == reference.keys()
    for k in reference:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-4, atol=1e-5, msg=k)
    # and training did move the weights away from the initialisation
    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4)).state_dict()
    assert not torch.allclose(got["0.weight"], init["0.weight"])


def test_ddp_under_torchrun_matches_gloo(tmp_path, gloo_weights):
    out = str(tmp_path / "cohort.pt")
    proc = _torchrun("cohort", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_weights_match(out, gloo_weights)


def _cohort_tool():
    """The built `cohort` (ctest sets COHORT_TOOL). It is built wherever these tests are, so a tool
    missing or one whose `run --help` fails is a failure here, never a skip."""
    tool = os.environ.get("COHORT_TOOL", "")
    assert tool, "COHORT_TOOL is not set: run these tests through ctest, or set it to build/tools/cohort"
    shown = subprocess.run([tool, "run", "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, f"`{tool} run --help` exited {shown.returncode}: {shown.stderr.strip()}"
    return tool


def test_ddp_under_cohort_run_matches_gloo(tmp_path, gloo_weights):
    tool = _cohort_tool()
    out = str(tmp_path / "cohort_run.pt")
    cmd = [tool, "run", "--nproc-per-node", str(WORLD), sys.executable,
           os.path.join(HERE, "ddp_script.py"), "--backend", "cohort", "--out", out]
    env = base_env()
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(k, None)  # the launcher decides
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_weights_match(out, gloo_weights)


def test_a_rank_that_exits_0_early_is_blamed_under_cohort_run():
    # Rank 1 exits with code 0 after allreduce #1; rank 0 then fails in #2. The torch backend's
    # communicator meets on torch's store, so it reads none of the launcher's exit records: the
    # launcher itself names rank 1 first, what it did last and what rank 0 waited in.
    tool = _cohort_tool()
    env = base_env(COHORT_TIMEOUT="30")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(k, None)  # the launcher decides
    proc = subprocess.run([tool, "run", "-n", "2", sys.executable, os.path.join(HERE, "early_exit_worker.py")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr  # rank 0's code: an exit with code 0 fails nothing by itself
    summary = [l for l in proc.stderr.splitlines() if "job failed (exit 1): " in l]
    assert summary, proc.stderr
    assert "job failed (exit 1): rank 1 on " in summary[0], proc.stderr
    assert " exited with code 0 after allreduce #1 while rank 0 waited for it in allreduce #2; then rank 0 " \
        in summary[0], proc.stderr


def test_operation_numbers_are_the_users_calls(tmp_path):
    # 100 all_reduces of one 1 MiB tensor (it moves into shared memory at the second, then runs in
    # place), then a 101st whose size differs between the ranks. Every counter the user sees counts the
    # user's calls, not operations of the backend's own: the error names operation #101, the flight
    # recorder's last allreduce is #101, and --stats counts 101 operations per rank (main counted 203:
    # a 48-byte allreduce before each call, and a barrier for the move).
    tool = os.environ.get("COHORT_TOOL", "")
    if not tool or subprocess.run([tool, "run", "--help"], capture_output=True).returncode != 0:
        pytest.skip("`cohort run` is not built in this tree")
    calls = 100
    trace_dir = tmp_path / "trace"
    cmd = [tool, "run", "--nproc-per-node", "2", "--stats", "--trace-dir", str(trace_dir), sys.executable,
           os.path.join(HERE, "op_count_worker.py"), str(calls)]
    env = base_env()
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(k, None)  # the launcher decides
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output  # the workers exit 3 after the mismatch
    assert output.count("MOVED True") == 2, output  # the in-place path really ran
    raised = [l for l in output.splitlines() if "RAISED " in l]
    assert len(raised) == 2, output
    for line in raised:
        assert f"allreduce #{calls + 1} " in line and "mismatched calls" in line, line
    import json
    for rank in (0, 1):
        dump = json.loads((trace_dir / f"rank{rank}.json").read_text())
        last = max(op["seq"] for op in dump["ops"] if op["op"] == "allreduce")
        assert last == calls + 1, f"rank {rank}: flight recorder's last allreduce #{last}"
    summary = [json.loads(l[l.index("{"):]) for l in proc.stderr.splitlines() if "cohort_stats_summary" in l]
    assert summary, output
    ops = {r["rank"]: r["ops"] for r in summary[-1]["cohort_stats_summary"]["ranks"]}
    assert ops == {0: calls + 1, 1: calls + 1}, f"--stats operations per rank: {ops}"


def test_killed_rank_makes_the_others_raise_within_2s(tmp_path):
    stamp = str(tmp_path / "died_at")
    world = 3
    start = time.monotonic()
    results = run_ranks([os.path.join(HERE, "kill_worker.py"), "1", stamp], world, timeout=60,
                        env_extra={"COHORT_TIMEOUT": "30"})
    assert time.monotonic() - start < 60
    assert results[1][0] == -9, describe(results)  # the victim really was SIGKILLed
    for rank in (0, 2):
        rc, out, err = results[rank]
        assert rc == 0, describe(results)
        line = [l for l in out.splitlines() if l.startswith("RAISED ")]
        assert line, describe(results)
        seconds = float(line[0].split()[1])
        assert seconds < 2.0, f"rank {rank} raised {seconds:.3f} s after the death: {line[0]}"


def test_operation_timeout_is_kept(tmp_path):
    # AllreduceOptions.timeout (300 ms) is shorter than the group's (60 s): the operation fails on
    # its own deadline with a message naming it, instead of waiting for the group's.
    results = run_ranks([os.path.join(HERE, "op_timeout_worker.py")], 2, timeout=60)
    rc, out, err = results[0]
    assert rc == 0, describe(results)
    line = [l for l in out.splitlines() if l.startswith("RAISED ")]
    assert line, describe(results)
    seconds = float(line[0].split()[1])
    assert 0.25 <= seconds < 2.0, line[0]
    assert "timeout of 300 ms" in line[0] and "ALLREDUCE" in line[0], line[0]


def test_monitored_barrier_after_a_failed_one_passes():
    # Barrier 0 fails because rank 1 is late; the next three, both ranks on time, pass on both ranks.
    # Rank 0 names the late rank; rank 1 fails barrier 0 with rank 0's verdict as soon as it arrives
    # (not after its own timeout). (A rank on time meets torch's own case, test_monitored_barrier_gloo
    # in tests/torch_suite.)
    results = run_ranks([os.path.join(HERE, "monitored_barrier_worker.py")], 2, timeout=60)
    assert all(rc == 0 for rc, _, _ in results), describe(results)
    lines = {}
    for rank, (rc, out, err) in enumerate(results):
        for line in out.splitlines():
            if line.startswith("B"):
                lines[(line.split()[0], rank)] = line
    for i in (1, 2, 3):
        for rank in range(2):
            assert lines.get((f"B{i}", rank)) == f"B{i} {rank} OK", describe(results)
    assert "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms" in lines.get(("B0", 0), ""), describe(results)
    b0 = lines.get(("B0", 1), "")
    assert "Rank 1 successfully reached monitoredBarrier, but received errors" in b0, describe(results)
    assert "rank 0 failed this barrier (rank 1 did not pass it in time)" in b0, describe(results)
    assert float(b0.split()[3]) < 0.9, b0


def test_group_timeout_names_where_it_came_from():
    # init_process_group(timeout=3 s) is the group's deadline, and its TimeoutError names it as such,
    # not COHORT_TIMEOUT (which was not set).
    results = run_ranks([os.path.join(HERE, "group_timeout_worker.py")], 2, timeout=60)
    rc, out, err = results[0]
    assert rc == 0, describe(results)
    line = [l for l in out.splitlines() if l.startswith("RAISED ")]
    assert line, describe(results)
    seconds = float(line[0].split()[1])
    assert seconds < 6.0, line[0]
    assert "timed out after 3.0 s, its timeout (timeout=0:00:03 given to init_process_group or new_group), waiting for" in line[0], line[0]
    assert "COHORT_TIMEOUT" not in line[0], line[0]


def test_process_groups_of_new_generations_in_the_same_process():
    # destroy_process_group + init_process_group, three times, each generation at its own store.
    ports = [str(free_port()) for _ in range(3)]
    results = run_ranks([os.path.join(HERE, "reinit_worker.py"), "generations"] + ports, 3, timeout=60)
    assert all(rc == 0 for rc, _, _ in results), describe(results)
    for rank, (rc, out, err) in enumerate(results):
        assert f"OK {rank} generations=3" in out, describe(results)


def test_after_a_lost_rank_the_survivors_destroy_the_group_and_go_on_smaller():
    # Rank 2 dies inside generation 0: ranks 0 and 1 get the error (naming rank 2), destroy the failed
    # group at once and build generation 1 as a world of 2 in the same processes.
    ports = [str(free_port()) for _ in range(2)]
    results = run_ranks([os.path.join(HERE, "reinit_worker.py"), "after_failure"] + ports, 3, timeout=60,
                        env_extra={"COHORT_TIMEOUT": "30"})
    assert results[2][0] == -9, describe(results)
    for rank in (0, 1):
        rc, out, err = results[rank]
        assert rc == 0, describe(results)
        line = [l for l in out.splitlines() if l.startswith(f"OK {rank} ")]
        assert line, describe(results)
        fields = dict(f.split("=") for f in line[0].split()[2:])
        assert float(fields["destroy_s"]) < 2.0, line[0]
        assert fields["named_rank_2"] == "True", describe(results)


def test_a_busy_wait_holding_the_gil_does_not_stall_the_next_operation():
    # busy_wait_worker.py: operation B must complete while each rank spins on it with the GIL held,
    # right after dropping operation A (the backend's worker thread must not need the GIL between them).
    results = run_ranks([os.path.join(HERE, "busy_wait_worker.py")], 2, timeout=60)
    assert all(rc == 0 for rc, _, _ in results), describe(results)
    for rank, (rc, out, err) in enumerate(results):
        assert out.startswith("OK "), describe(results)


def test_a_group_made_after_another_is_not_taken_for_it_under_cohort_run():
    # regroup_worker.py: a group (its operation #1 an allgather) destroyed, then another (its #1 an
    # allreduce), in the same processes: the launcher must see two communicators, not one whose
    # operation #1 "mismatched".
    tool = _cohort_tool()
    env = base_env()
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(k, None)  # the launcher decides
    proc = subprocess.run([tool, "run", "-n", "2", sys.executable, os.path.join(HERE, "regroup_worker.py")],
                          env=env, capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "OK 0" in output and "OK 1" in output, output
    assert "mismatch" not in output, output
