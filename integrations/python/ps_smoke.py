"""Smoke test of the cohort_ps Python module: a worker of a parameter-server job.

    PYTHONPATH=build/integrations/python \
        build/tools/cohort run --ps 1 --nproc-per-node 2 /usr/bin/python3 integrations/python/ps_smoke.py

Every worker declares the same tables, pushes gradients it knows, pulls the rows back and checks
them; worker 0 saves, changes and loads the tables, and every worker waits for that check's result.
Each prints "ps_smoke: worker W of N OK" (exit status 0) or fails with a traceback. It holds
under every consistency mode (--ps-mode async, bsp, stale:K): every worker ends the same number of
steps, a worker checks only its own rows directly, and the row every worker pushes to is polled
until all the pushes are in. With --ps-server program the servers run this script too: they serve.
"""
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import cohort_ps


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def close(a, b, what, tol=1e-6):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or not np.allclose(a, b, rtol=tol, atol=tol):
        raise AssertionError(f"{what}: got {a.tolist()}, expected {b.tolist()}")


def raises(exc, fn, what):
    try:
        fn()
    except exc as e:
        return e
    raise AssertionError(f"{what}: no {exc.__name__} raised")


def main():
    if os.environ.get("COHORT_ROLE") == "server":
        cohort_ps.serve_from_env()
        return
    with cohort_ps.Client.from_env() as ps:
        w, n = ps.worker_index(), ps.num_workers()
        check(0 <= w < n, f"worker_index {w} outside 0..{n - 1}")
        check(ps.num_servers() >= 1, "no servers")
        mode = ps.mode()
        dim = 4
        base = 1000 * (w + 1)  # this worker's own ids; id 7 is everyone's

        # 1. Sparse SGD table (lr 0.5): the row of an id is -lr * (sum of its gradients).
        ps.create_table("sgd", dim=dim, optimizer="sgd", lr=0.5)
        ps.create_table("sgd", dim=dim, optimizer="sgd", lr=0.5)  # declaring again is fine
        cfg = ps.table("sgd")
        check(cfg["dim"] == dim and cfg["optimizer"] == "sgd" and cfg["lr"] == 0.5 and not cfg["dense"],
              f"table('sgd') is {cfg}")
        close(ps.pull("sgd", np.array([base + 99], dtype=np.uint64)), np.zeros((1, dim)), "an untouched row")
        ids = np.array([base, base + 1, base, 7], dtype=np.int64)  # base twice: its gradients add up
        grads = np.arange(4 * dim, dtype=np.float32).reshape(4, dim) / 8
        ps.push("sgd", ids, grads)
        ps.step()
        rows = ps.pull("sgd", np.array([base, base + 1], dtype=np.uint64))
        check(rows.dtype == np.float32 and rows.shape == (2, dim), f"pull gave {rows.dtype} {rows.shape}")
        close(rows, -0.5 * np.stack([grads[0] + grads[2], grads[1]]), "own rows after one push")
        # A list of ids, a 2-d id array, a float64 gradient, an `out` array.
        out = np.empty((3, dim), dtype=np.float32)
        got = ps.pull("sgd", [base + 1, base, base + 1], out=out)
        check(got is out or np.shares_memory(got, out), "pull(out=...) did not fill `out`")
        close(out, -0.5 * np.stack([grads[1], grads[0] + grads[2], grads[1]]), "pull into out")
        close(ps.pull("sgd", np.array([[base], [base + 1]])), rows, "2-d ids")
        check(ps.pull("sgd", []).shape == (0, dim), "an empty pull")

        # 2. push_pull: push, end the step, pull, in one call; then the row everyone pushed to.
        g2 = np.ones((1, dim), dtype=np.float64)
        rows = ps.push_pull("sgd", np.array([base + 1]), g2, np.array([base + 1, 7]))
        close(rows[0], -0.5 * (grads[1] + 1.0), "push_pull's own row")
        expect7 = -0.5 * n * grads[3]  # every worker pushed grads[3] to id 7
        deadline = time.monotonic() + 60
        while True:
            row7 = ps.pull("sgd", [7])[0]
            if np.allclose(row7, expect7, atol=1e-5) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        close(row7, expect7, f"the shared row 7 after {n} workers pushed to it", tol=1e-5)

        # 3. Adagrad, constant initializer: a fresh row moves by lr * sign(g) on its first push.
        ps.create_table("ada", dim=2, optimizer="adagrad", lr=0.1, init="constant", init_a=0.25)
        close(ps.pull("ada", [base]), [[0.25, 0.25]], "constant initializer")
        ps.push("ada", [base], np.array([[3.0, -0.5]], dtype=np.float32))
        ps.step()
        close(ps.pull("ada", [base]), [[0.25 - 0.1, 0.25 + 0.1]], "adagrad's first step", tol=1e-5)

        # 4. A dense table: rows 0..9, row 9 is the last; row 10 is refused by the server.
        ps.create_table("dense", dim=3, dense=True, rows=10, optimizer="sgd", lr=1.0)
        ps.push("dense", [9], np.full((1, 3), 0.25 * (w + 1), dtype=np.float32))
        ps.step()
        raises(ValueError, lambda: ps.pull("dense", [10]), "a pull past a dense table's end")
        raises(cohort_ps.InvalidArgument, lambda: ps.pull("dense", [10]), "a pull past a dense table's end")

        # 5. Mistakes are caught here or by the server, and the client stays usable.
        raises(ValueError, lambda: ps.push("sgd", [base], np.zeros(dim + 1, dtype=np.float32)), "a wrong gradient size")
        raises(ValueError, lambda: ps.pull("sgd", [-1]), "a negative id")
        raises(TypeError, lambda: ps.pull("sgd", np.array([1.5])), "a float id")
        raises(cohort_ps.Error, lambda: ps.pull("no such table", [1]), "an unknown table")
        e = raises(cohort_ps.InvalidArgument, lambda: ps.create_table("sgd", dim=dim + 1, optimizer="sgd", lr=0.5),
                   "a declaration that differs")
        check("dim" in str(e), f"the mismatch error does not name the field: {e}")
        raises(ValueError, lambda: ps.create_table("x", dim=1, optimizer="adadelta"), "an unknown optimizer")
        close(ps.pull("sgd", [base + 1]), [-0.5 * (grads[1] + 1.0)], "own row after the refused calls")

        # 6. Statistics (summed over the servers).
        st = ps.stats("sgd")
        check(set(st) == {"rows", "bytes", "applied_rows", "direct_applied_rows"}, f"stats keys {sorted(st)}")
        check(st["rows"] >= 3 and st["bytes"] > 0, f"stats('sgd') is {st}")
        # Workers on the servers' host, async mode: pushes go through the shared rows.
        if os.environ.get("COHORT_PS_DIRECT") != "0":
            check(0 < st["direct_applied_rows"] <= st["applied_rows"], f"stats('sgd') is {st}")

        # 7. A torch CPU tensor goes in as it is (through numpy), when torch is around.
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            t = torch.from_numpy(ps.pull("sgd", torch.tensor([base, base + 1])))
            close(t.numpy(), np.stack([-0.5 * (grads[0] + grads[2]), -0.5 * (grads[1] + 1.0)]), "torch ids")

        # 8. Save and load (worker 0), once every worker has pushed all it will: each adds 1 to a
        #    counter row and waits until it reads n (a barrier made of the table itself).
        ps.create_table("done", dim=1, dense=True, rows=1, optimizer="sgd", lr=1.0)
        ps.push("done", [0], np.array([-1.0], dtype=np.float32))
        ps.step()
        deadline = time.monotonic() + 60
        while ps.pull("done", [0])[0, 0] < n - 0.5 and time.monotonic() < deadline:
            time.sleep(0.01)
        close(ps.pull("done", [0]), [[n]], "the counter every worker added 1 to")
        if w == 0:
            d = tempfile.mkdtemp(prefix="ps_smoke.")
            before = ps.pull("sgd", [base, base + 1, 7])
            ps.save(d)
            check(os.path.exists(os.path.join(d, "manifest.json")), f"{d}/manifest.json missing after save")
            if mode != "bsp":  # (bsp would hold this push until a step every worker ends)
                ps.push("sgd", [base], np.ones((1, dim), dtype=np.float32))  # changed after the save...
            ps.load(d)  # ... and back
            close(ps.pull("sgd", [base, base + 1, 7]), before, "rows after save, push, load")
            shutil.rmtree(d)

        # 9. Worker 0's save/load check is every worker's result: worker 0 adds 1 to a row once that
        #    check passed, and no worker says OK before it reads it (one that did would call the job
        #    good while worker 0 failed). A worker 0 that fails exits non-zero, which stops the job.
        ps.create_table("saved", dim=1, dense=True, rows=1, optimizer="sgd", lr=1.0)
        if w == 0:
            ps.push("saved", [0], np.array([-1.0], dtype=np.float32))
        ps.step()
        deadline = time.monotonic() + 60
        while ps.pull("saved", [0])[0, 0] < 0.5 and time.monotonic() < deadline:
            time.sleep(0.01)
        close(ps.pull("saved", [0]), [[1]], "worker 0's mark that its save, push, load check passed")

        clock = ps.clock()
        check(clock == 6, f"clock() is {clock} after 6 steps")
    check(ps.closed, "the client is not closed after `with`")
    raises(ValueError, lambda: ps.step(), "a call on a closed client")
    print(f"ps_smoke: worker {w} of {n} OK (mode {mode})", flush=True)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"ps_smoke: worker {os.environ.get('RANK', '?')}: FAILED: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
