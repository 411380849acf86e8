"""Helpers shared by the cohort_torch tests: free ports, environment, launching ranks."""
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("COHORT_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE)))
# torchrun as shipped with Debian's torch 1.13 + Python 3.11 dies before starting workers;
# the peers folder (beside the repository, as in CI) has the same torchrun with that one fix.
TORCHRUN311 = os.path.join(SOURCE_DIR, "..", "shared", "peers", "torchrun311.py")


def free_port():
    """A TCP port the OS just handed out (bind to 0), for MASTER_PORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra):
    """Environment for child processes: the built module on PYTHONPATH, loopback only."""
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["MASTER_ADDR"] = "127.0.0.1"
    env.setdefault("OMP_NUM_THREADS", "1")
    # torch >= 2.4 makes TCPStore use libuv by default, and Debian 13's torch 2.6 is built without it
    # ("use_libuv was requested but PyTorch was build without libuv support"). env:// and torchrun's
    # c10d rendezvous honour USE_LIBUV; torch 1.x ignores it.
    env.setdefault("USE_LIBUV", "0")
    paths = [p for p in [os.environ.get("COHORT_TORCH_MODULE_DIR"), HERE] if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_ranks(script_args, world, timeout=60, env_extra=None):
    """Starts `world` processes of `python3 <script_args>` with RANK/WORLD_SIZE/LOCAL_RANK set,
    waits for all (bounded), returns [(returncode, stdout, stderr)]."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = base_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                       MASTER_PORT=port, **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable] + script_args, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def describe(results):
    return "\n".join(f"--- rank {r}: exit {rc}\nstdout:\n{out}\nstderr:\n{err}"
                     for r, (rc, out, err) in enumerate(results))
