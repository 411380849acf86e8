"""cohort_torch with CUDA tensors (torch 2.x with CUDA and a GPU; skipped elsewhere, with the reason).
scripts/gpu_check.sh runs these on a GPU machine; on this project's CI machine (no GPU, Debian's
CPU-only torch 1.13) every case is skipped."""
import os
import subprocess
import sys

import pytest
import torch

from dist_util import HERE, base_env

TORCH_MAJOR = int(torch.__version__.split(".")[0])


def _need_cuda():
    if TORCH_MAJOR < 2:
        pytest.skip(f"torch {torch.__version__}: CUDA tensors need the torch 2.x backend")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} sees no GPU (torch.cuda.is_available() is False)")


def _cohort_run(args, worker_args, timeout=240):
    tool = os.environ.get("COHORT_TOOL", "")
    env = base_env()
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    cmd = [tool, "run"] + args + [sys.executable, os.path.join(HERE, "cuda_worker.py")] + worker_args
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_cuda_tensors_one_rank_per_gpu_go_to_nccl():
    _need_cuda()
    n = torch.cuda.device_count()
    p = _cohort_run(["--gpus-per-node", "auto"], [])
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("OK 4") == n, p.stdout


def test_documented_form_cpu_cohort_cuda_nccl():
    _need_cuda()
    p = _cohort_run(["--gpus-per-node", "auto"], ["--backend", "cpu:cohort,cuda:nccl"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 4 cpu:cohort,cuda:nccl" in p.stdout, p.stdout


def test_ranks_sharing_a_gpu_are_staged_with_one_warning():
    _need_cuda()
    p = _cohort_run(["-n", "2", "--gpus-per-node", "1", "--gpu-share"], [])
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("OK 4") == 2, p.stdout
    assert "CUDA tensors are copied to host memory" in p.stderr, p.stderr
