#!/usr/bin/env python3
"""PyTorch's own distributed test suite, run against a chosen backend: cohort, or gloo beside it.

    run_pytorch_suite.py --backend cohort --world-size 2 [-k NAME ...] [--shard I/N] [--json OUT]

The suite is `torch/testing/_internal/distributed/distributed_test.py` as the installed torch ships it
(`DistributedTest._DistTestBase`: every collective and dtype, groups, send/recv, barriers, profiling,
DDP). Each test spawns WORLD_SIZE processes that join a process group of the chosen backend through a
file:// store, as PyTorch's own test/distributed/test_distributed_spawn.py does (not shipped by Debian;
this is our own runner of the same shape).

A third-party backend takes part the way PyTorch provides for: it is registered (`import cohort_torch`)
before the suite is imported, and its name is added to `DistTestCases.backend_feature`. Many tests are
also gated on gloo's *name* (`require_backend({"gloo"})`, `BACKEND != "gloo"`): they are written for
"the CPU backend" and would never run for cohort. The runner lifts those gates for cohort by rewriting
the suite's source as it loads it (the file on disk is untouched); GATE_LIFTS below lists each rewrite
and why. The gloo run goes through the same rewritten source, where the rewrites change nothing.

Results: one line per test (PASS, FAIL, ERROR, SKIP with the reason), a summary, and with --json a file
that scripts/pytorch_suite.sh compares across backends.
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))

# The suite reads BACKEND, WORLD_SIZE and TEMP_DIR when it is imported, in this process and in every
# spawned rank (multiprocessing's spawn re-imports this file as __mp_main__): the parent puts them in the
# environment before importing anything of torch's test package, and the children inherit them.
if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _parser.add_argument("--backend", default="cohort", help="cohort or gloo (default cohort)")
    _parser.add_argument("--world-size", type=int, default=2)
    _parser.add_argument("-k", action="append", default=[],
                         help="run only tests whose name contains this (repeatable)")
    _parser.add_argument("--exact", action="append", default=[], help="run only the test of exactly this name")
    _parser.add_argument("--shard", default="1/1", help="I/N: run the I-th of N interleaved parts")
    _parser.add_argument("--json", help="write the results here")
    _parser.add_argument("--list", action="store_true", help="list the selected tests and exit")
    _parser.add_argument("--lifts", action="store_true", help="print the gate lifts and exit")
    ARGS = _parser.parse_args()
    os.environ["BACKEND"] = ARGS.backend
    os.environ["WORLD_SIZE"] = str(ARGS.world_size)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix=f"torch-suite-{ARGS.backend}-"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # torch >= 2.4's TCPStore wants libuv, which Debian 13's torch lacks; torch 1.x ignores this.
    os.environ.setdefault("USE_LIBUV", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Debian 12 packages no `expecttest` (a dependency of torch.testing's TestCase, used only for
# assertExpectedInline, which no distributed test calls). Where it is missing, a minimal one from this
# folder stands in; spawned ranks find it through PYTHONPATH.
try:
    import expecttest  # noqa: F401
except ImportError:
    _shim = os.path.join(HERE, "shim")
    sys.path.insert(0, _shim)
    os.environ["PYTHONPATH"] = os.pathsep.join([_shim] + [p for p in [os.environ.get("PYTHONPATH")] if p])

BACKEND = os.environ["BACKEND"]
if BACKEND == "cohort":
    import cohort_torch  # noqa: F401  registers backend "cohort" with torch.distributed

import torch  # noqa: E402
from torch.testing._internal import common_distributed  # noqa: E402

# The features cohort offers, in the suite's own vocabulary (common_distributed.DistTestCases):
#   plugin    a backend registered through torch.distributed.Backend.register_backend;
#   ddp       DistributedDataParallel over it;
#   subgroup  new_group / new_subgroups of it;
#   cuda, gpu CUDA tensors (routed to NCCL, docs/gpu.md); without a GPU those tests skip for every backend.
if BACKEND == "cohort":
    for _feature in ("plugin", "ddp", "subgroup", "cuda", "gpu"):
        common_distributed.DistTestCases.backend_feature[_feature].add("cohort")

# An environment defect, not a backend's: torch 1.13's torch.distributed._shard does not import under
# Python 3.11 (a dataclass with a mutable default, rejected since 3.11), and the suite's ranks turn on
# DDP's ReplicatedTensor interop, which imports it in every DistributedDataParallel(): every DDP test
# would then fail before any communication, for gloo as for cohort. Where that import fails, the
# interop stays off (DDP's default) and ENVIRONMENT_NOTES says so in the results.
ENVIRONMENT_NOTES = []
try:
    import torch.distributed._shard  # noqa: F401
except Exception as e:  # ValueError on torch 1.13 + Python 3.11
    from torch.nn.parallel import _replicated_tensor_ddp_utils
    _replicated_tensor_ddp_utils._set_ddp_with_replicated_tensor = lambda value: None
    ENVIRONMENT_NOTES.append(f"DDP's ReplicatedTensor interop left off: torch.distributed._shard does not "
                             f"import here ({type(e).__name__}: {str(e)[:120]})")

# Gate lifts: (name, pattern, replacement, why). Applied to the suite's source text as it is loaded.
GLOO_LIKE = ("gloo", "cohort")
GATE_LIFTS = [
    ("gloo-name gates",
     r'BACKEND != "gloo"', 'BACKEND not in _GLOO_LIKE',
     'tests skipped unless BACKEND == "gloo" test CPU collectives, timeouts, batched CPU send/recv, '
     'sparse allreduce, object collectives and DDP on CPU, all of which cohort offers'),
    ("gloo-name branches",
     r'BACKEND == "gloo"', 'BACKEND in _GLOO_LIKE',
     'branches taken for gloo expect the CPU backend\'s behaviour (e.g. which dtypes and ops are allowed), '
     'which cohort matches'),
    ("require_backend({... gloo ...})",
     r'    if BACKEND not in backends:\n',
     '    if BACKEND not in backends and not (BACKEND == "cohort" and "gloo" in backends):\n',
     'require_backend({"gloo"}) / ({"gloo", "nccl"}) guards monitored barrier, DDP with uneven inputs, '
     'join, communication hooks and the debug-mode checks: cohort implements each'),
]

SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"


def _load_suite():
    """Imports the suite from its installed file with GATE_LIFTS applied, under its own module name
    (so that pickling its classes into spawned ranks finds them), and returns the module."""
    import importlib.util
    spec = importlib.util.find_spec(SUITE_MODULE)
    with open(spec.origin) as f:
        source = f.read()
    counts = {}
    for name, pattern, replacement, _why in GATE_LIFTS:
        source, n = re.subn(pattern, replacement, source)
        counts[name] = n
    module = types.ModuleType(SUITE_MODULE)
    module.__file__ = spec.origin
    module.__spec__ = spec
    module._GLOO_LIKE = GLOO_LIKE
    sys.modules[SUITE_MODULE] = module
    exec(compile(source, spec.origin, "exec"), module.__dict__)
    module._GATE_LIFT_COUNTS = counts
    return module


suite = _load_suite()


class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
    """One class per run, as in PyTorch's test_distributed_spawn.py: every test spawns its ranks."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


# Names of the tests, in the suite's order.
ALL_TESTS = sorted(n for n in dir(TestDistBackendWithSpawn) if n.startswith("test_"))


class _Recorder(unittest.TestResult):
    """Keeps one result per test, with the reason of a skip and the tail of a failure, and prints a line
    as each ends."""

    def __init__(self):
        super().__init__()
        self.rows = []
        self._started = 0.0

    def startTest(self, test):
        super().startTest(test)
        self._started = time.monotonic()

    def _row(self, test, status, detail=""):
        name = test.id().split(".")[-1]
        seconds = time.monotonic() - self._started
        self.rows.append({"test": name, "status": status, "seconds": round(seconds, 2), "detail": detail})
        first = detail.strip().splitlines()[-1] if detail.strip() else ""
        print(f"{status:5} {name} ({seconds:.1f} s){': ' + first[:200] if first else ''}", flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._row(test, "PASS")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._row(test, "FAIL", self.failures[-1][1])

    def addError(self, test, err):
        super().addError(test, err)
        self._row(test, "ERROR", self.errors[-1][1])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._row(test, "SKIP", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._row(test, "XFAIL")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._row(test, "FAIL", "unexpected success")


def main():
    if ARGS.lifts:
        for name, pattern, _replacement, why in GATE_LIFTS:
            print(f"{name}: {suite._GATE_LIFT_COUNTS[name]} place(s) ({pattern!r}): {why}")
        return 0
    selected = [t for t in ALL_TESTS
                if (not ARGS.k or any(k in t for k in ARGS.k)) and (not ARGS.exact or t in ARGS.exact)]
    index, count = (int(x) for x in ARGS.shard.split("/"))
    selected = selected[index - 1::count]
    if ARGS.list:
        print("\n".join(selected))
        return 0
    print(f"torch {torch.__version__}, backend {BACKEND}, world size {ARGS.world_size}: "
          f"{len(selected)} of {len(ALL_TESTS)} tests; gate lifts "
          + ", ".join(f"{k} x{v}" for k, v in suite._GATE_LIFT_COUNTS.items()), flush=True)
    for note in ENVIRONMENT_NOTES:
        print(f"note: {note}", flush=True)
    recorder = _Recorder()
    started = time.monotonic()
    unittest.TestSuite(TestDistBackendWithSpawn(t) for t in selected).run(recorder)
    totals = {s: sum(r["status"] == s for r in recorder.rows) for s in ("PASS", "FAIL", "ERROR", "SKIP")}
    print(f"{BACKEND} world size {ARGS.world_size}: ran {len(recorder.rows)}, "
          + ", ".join(f"{k.lower()} {v}" for k, v in totals.items())
          + f" in {time.monotonic() - started:.0f} s")
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump({"torch": torch.__version__, "python": sys.version.split()[0], "backend": BACKEND,
                       "world_size": ARGS.world_size, "lifts": suite._GATE_LIFT_COUNTS,
                       "environment_notes": ENVIRONMENT_NOTES,
                       "results": recorder.rows}, f, indent=1)
    return 0 if totals["FAIL"] + totals["ERROR"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
