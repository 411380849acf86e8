"""The `horovod` name, horovodrun's line and hvd.elastic under cohort (docs/horovod.md), with real processes.

Run through ctest (label `python`), or by hand:
    COHORT_TORCH_MODULE_DIR=build/integrations/python COHORT_TOOL=build/tools/cohort \
        /usr/bin/python3 -m pytest -q tests/python/test_horovod_launch.py
The build folder's integrations/python holds the modules and links to the packages `cohort` and `horovod`
(integrations/python/CMakeLists.txt): that one folder on PYTHONPATH serves `import horovod.torch`.
"""
import glob
import os
import shutil
import subprocess
import sys
import socket
import tempfile
import time

import pytest

from dist_util import HERE, base_env, free_port


def _port_open(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _tool():
    tool = os.environ.get("COHORT_TOOL", "")
    assert tool, "COHORT_TOOL is not set: run these tests through ctest, or set it to build/tools/cohort"
    return tool


def _env(**extra):
    env = base_env(**extra)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "COHORT_HOROVOD"):
        env.pop(k, None)  # the launcher decides
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _fake_real_horovod(folder):
    """A stand-in for an installed Horovod: a `horovod` package whose torch module says whose it is."""
    os.makedirs(os.path.join(folder, "horovod", "torch"))
    with open(os.path.join(folder, "horovod", "__init__.py"), "w") as f:
        f.write("WHOSE = 'the real one'\n")
    with open(os.path.join(folder, "horovod", "torch", "__init__.py"), "w") as f:
        f.write("import horovod\nWHOSE = horovod.WHOSE\n")


PROBE = """
import horovod, horovod.torch as hvd
print(getattr(hvd, 'WHOSE', hvd.__name__), horovod.__file__)
"""


def _probe(pythonpath, **extra):
    env = _env(**extra)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def test_horovod_name_is_cohorts_only_where_no_real_horovod_is_found():
    built = os.environ["COHORT_TORCH_MODULE_DIR"]
    with tempfile.TemporaryDirectory() as real:
        _fake_real_horovod(real)
        # No Horovod installed: cohort's.
        assert _probe([built]).startswith("cohort.horovod.torch "), _probe([built])
        # A real Horovod after cohort's on the path, or before it: the real one, whole.
        for order in ([built, real], [real, built]):
            out = _probe(order)
            assert out == f"the real one {real}/horovod/__init__.py", (order, out)
        # Asked for: cohort's even then.
        out = _probe([built, real], COHORT_HOROVOD="1")
        assert out.startswith("cohort.horovod.torch "), out
        # And cohort.horovod.torch is always cohort's.
        env = _env()
        env["PYTHONPATH"] = os.pathsep.join([real, built])
        proc = subprocess.run([sys.executable, "-c", "import cohort.horovod.torch as h; print(h.__name__)"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.stdout.strip() == "cohort.horovod.torch", proc.stdout + proc.stderr


def test_a_horovod_script_runs_under_the_horovodrun_line():
    horovodrun = os.path.join(os.path.dirname(_tool()), "horovodrun")
    proc = subprocess.run([horovodrun, "-np", "2", "--gloo", sys.executable, os.path.join(HERE, "hvd_launch_worker.py")],
                          env=_env(), capture_output=True, text=True, timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for r in range(2):
        assert f"HVD OK rank={r}" in proc.stdout, output


def test_a_horovod_script_runs_under_plain_mpirun():
    # Horovod's MPI mode: no cohort launcher, no MASTER_ADDR; hvd.init() finds rank 0 through mpirun's PMIx.
    mpirun = shutil.which("mpirun")
    if not mpirun:
        pytest.skip("mpirun is not installed (Debian's openmpi-bin)")
    proc = subprocess.run([mpirun, "--allow-run-as-root", "-np", "2", sys.executable,
                           os.path.join(HERE, "hvd_launch_worker.py")],
                          env=_env(), capture_output=True, text=True, timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for r in range(2):
        assert f"HVD OK rank={r}" in proc.stdout, output


def test_elastic_training_resumes_from_the_last_commit_after_a_killed_rank():
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([_tool(), "run", "-n", "2", "--max-restarts", "1", "--kill-grace", "1",
                               sys.executable, os.path.join(HERE, "hvd_elastic_worker.py")],
                              env=_env(TMPDIR=tmp), capture_output=True, text=True, timeout=90)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output
        oks = [l for l in proc.stdout.splitlines() if "ELASTIC OK attempt=1" in l]
        assert len(oks) == 2, output
        # Both ranks resumed from one commit, and the commit files are gone after the success.
        assert len({l.split("resumed=")[1] for l in oks}) == 1, output
        assert glob.glob(os.path.join(tmp, "cohort-hvd-elastic-*", "*", "*")) == [], output


def test_elastic_training_goes_on_after_a_lost_node():
    # cohort's elastic job: two agents (`--nnodes 1:2`, COHORT_HOST_ID a and b standing for two hosts) meet;
    # node b is lost after step 3 (agent and worker SIGKILLed); a's next generation resumes from the commit.
    tool = _tool()
    port = str(free_port())
    script = os.path.join(HERE, "hvd_elastic_node_worker.py")
    with tempfile.TemporaryDirectory() as tmp:
        def agent(host):
            return subprocess.Popen([tool, "run", "--nnodes", "1:2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                                     "--master-port", port, "--rdzv-conf", "last_call_timeout=5", "--kill-grace", "1", "--max-restarts", "1",
                                     "--run-id", "hvd-elastic-test", sys.executable, script],
                                    env=_env(TMPDIR=tmp, COHORT_HOST_ID=host), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        a = agent("a")
        deadline = time.monotonic() + 30
        while not _port_open(int(port)):  # b joins the store that a's agent hosts
            assert time.monotonic() < deadline and a.poll() is None, "a's agent never opened the store"
            time.sleep(0.05)
        b = agent("b")
        out_b, _ = b.communicate(timeout=120)
        out_a, _ = a.communicate(timeout=120)
        assert b.returncode == -9, out_b  # the lost node
        assert a.returncode == 0, out_a + out_b
        assert "NODE ELASTIC OK generation=1" in out_a, out_a + out_b
        assert glob.glob(os.path.join(tmp, "cohort-hvd-elastic-*", "*", "a.*")) == [], out_a


def _wait_for(path, wanted, proc, what, limit_s=60):
    """Waits until every line of `wanted` is in the file at `path` (the workers' progress), or fails."""
    deadline = time.monotonic() + limit_s
    while True:
        text = open(path).read() if os.path.exists(path) else ""
        if all(w in text for w in wanted):
            return text
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, _ = proc.communicate(timeout=30)
            pytest.fail(f"{what}: not seen within {limit_s} s ({wanted}); progress:\n{text}\nhorovodrun:\n{out}")
        time.sleep(0.05)


def test_horovodrun_elastic_adds_and_removes_listed_hosts():
    # Horovod's elastic line: the discovery script prints the lines of a file this test rewrites. localhost runs its
    # agent here; hostB's starts through an ssh stand-in that runs it on this machine (COHORT_HOST_ID=hostB, so it
    # is a node of its own; PYTHONPATH, TMPDIR and HVD_PROGRESS reach it only as the driver forwards its
    # environment). hostB, added mid-job, joins at the next generation and gets the committed state;
    # removed mid-job, its agent is stopped (its ssh's stdin closed) and the survivor resumes from the last
    # commit; the worker checks its final weights against a replay (hvd_elastic_discovery_worker.py).
    horovodrun = os.path.join(os.path.dirname(_tool()), "horovodrun")
    with tempfile.TemporaryDirectory() as tmp:
        hosts, progress, discover, ssh = (os.path.join(tmp, n) for n in ("hosts", "progress", "discover.sh", "ssh"))
        with open(hosts, "w") as f:
            f.write("localhost:1\n")
        with open(discover, "w") as f:
            f.write(f"#!/bin/sh\ncat {hosts}\n")
        with open(ssh, "w") as f:  # ssh HOST COMMAND...: COMMAND here, standing for HOST, as bare as an ssh session
            f.write('#!/bin/sh\nhost=$1; shift\necho "$host" >> ' + os.path.join(tmp, "ssh-hosts") +
                    '\nexec env -i PATH="$PATH" HOME="$HOME" COHORT_HOST_ID="$host" "$@"\n')
        for script in (discover, ssh):
            os.chmod(script, 0o755)

        def list_hosts(text):  # whole, then renamed: the script never reads half a file
            with open(hosts + ".new", "w") as f:
                f.write(text)
            os.replace(hosts + ".new", hosts)

        proc = subprocess.Popen([horovodrun, "-np", "1", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
                                 discover, "--ssh-command", ssh, sys.executable,
                                 os.path.join(HERE, "hvd_elastic_discovery_worker.py")],
                                env=_env(TMPDIR=tmp, HVD_PROGRESS=progress), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            _wait_for(progress, ["waiting size=1 rank=0 step=2"], proc, "one rank at step 2")
            list_hosts("localhost:1\nhostB:1\n")
            text = _wait_for(progress, ["waiting size=2 rank=0 step=5", "waiting size=2 rank=1 step=5"], proc,
                             "two ranks at step 5")
            # Both ranks of the grown job started from the commit of step 2: the new host's rank through sync.
            assert "size=2 rank=0 resumed=2" in text and "size=2 rank=1 resumed=2" in text, text
            list_hosts("localhost:1\n")
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        text = open(progress).read()
        assert proc.returncode == 0, out + text
        assert "DISCOVERY ELASTIC OK" in out, out + text
        assert "size=1 rank=0 resumed=5" in text, text
        assert "host hostB is listed with 1 slot: starting its agent" in out, out
        assert "host hostB is no longer listed by the discovery script: stopping its agent" in out, out
        assert open(os.path.join(tmp, "ssh-hosts")).read() == "hostB\n", out  # localhost's agent ran here
        assert glob.glob(os.path.join(tmp, "cohort-hvd-elastic-*", "*")) == [], out
