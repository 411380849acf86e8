"""One rank of the Horovod API test (cohort.horovod.torch's collectives), under `cohort run`.

Every rank builds every rank's input deterministically, so it computes each collective's expected
result with torch's own ops (sum/amin/amax/prod over the stacked inputs, cat, split) and compares it
with what hvd returned: exactly for integers, within the dtype's tolerance for floats. The error cases
come last: a mismatch must raise on every rank, and the next operation must work again.
Prints "OK <checks>" at the end; any failed check raises (non-zero exit).
"""
import datetime
import os
import sys

import torch

import cohort.horovod.torch as hvd

INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-12}

checks = 0


def make(rank, shape, dtype, salt=0):
    """Rank `rank`'s input: small positive integers (products fit in int8), or floats near 1."""
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, dtype=torch.float64)
    if dtype.is_floating_point:
        return (1.0 + 0.3 * torch.sin(i * 0.37 + rank * 1.3 + salt)).to(dtype).reshape(shape)
    if dtype == torch.bool:
        return ((torch.arange(n) + rank + salt) % 2 == 0).reshape(shape)
    if dtype.is_complex:
        return torch.complex(torch.sin(i + rank), torch.cos(i + salt)).to(dtype).reshape(shape)
    return ((torch.arange(n) + rank * 7 + salt) % 3 + 1).to(dtype).reshape(shape)


def same(what, got, want):
    global checks
    checks += 1
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype in TOL:
        tol = TOL[got.dtype]
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), f"{what}: {got} != {want}"


def expect(what, condition):
    global checks
    checks += 1
    assert condition, what


def reference(op, tensors):
    """What the ranks' `tensors` reduce to under Horovod's op, with torch's own ops."""
    dtype = tensors[0].dtype
    stack = torch.stack([t.double() for t in tensors])
    if op in (hvd.Sum, hvd.Average):
        out = stack.sum(0)
    elif op == hvd.Min:
        out = stack.amin(0)
    elif op == hvd.Max:
        out = stack.amax(0)
    else:
        out = stack.prod(0)
    if op == hvd.Average:
        out = out / len(tensors) if dtype.is_floating_point else torch.floor(out / len(tensors))
    return out.to(dtype)


_store = None


def settle(tag):
    """Returns once every rank has got here, through the job's store rather than a collective: a rank
    leaves a collective as soon as its own part is done, possibly before a slower rank has finished it,
    and cohort fails every pending operation of a communicator that fails. So before a mismatch that is
    meant to fail one known call on every rank, every rank must have finished the calls before it."""
    global _store
    if _store is None:
        _store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                            is_master=False, timeout=datetime.timedelta(seconds=30))
    if _store.add(f"hvd_ops_worker/settle/{tag}", 1) == hvd.size():
        _store.set(f"hvd_ops_worker/settled/{tag}", "1")
    _store.wait([f"hvd_ops_worker/settled/{tag}"], datetime.timedelta(seconds=30))


def raises(what, exc, fn):
    global checks
    try:
        fn()
    except exc as e:
        checks += 1
        return str(e)
    raise AssertionError(f"{what}: expected {exc.__name__}")


def main():
    hvd.init()
    me, n = hvd.rank(), hvd.size()
    everyone = range(n)

    # ---- basics: what the launcher said, and Horovod's topology (hosts with equal rank counts: the
    # cross ranks are the hosts' node ranks)
    expect("size", n == int(os.environ["WORLD_SIZE"]))
    expect("rank", me == int(os.environ["RANK"]))
    expect("local_rank", hvd.local_rank() == int(os.environ["LOCAL_RANK"]))
    expect("local_size", hvd.local_size() == int(os.environ["LOCAL_WORLD_SIZE"]))
    nodes = n // hvd.local_size()
    expect(f"cross_rank {hvd.cross_rank()} / cross_size {hvd.cross_size()} on node {os.environ['GROUP_RANK']} "
           f"of {nodes}", hvd.cross_rank() == int(os.environ["GROUP_RANK"]) and hvd.cross_size() == nodes)
    expect("is_homogeneous", hvd.is_homogeneous())
    expect("is_initialized", hvd.is_initialized())
    expect("probes", not hvd.mpi_built() and not hvd.gloo_built() and not hvd.mpi_enabled()
           and hvd.cuda_built() == (torch.version.cuda is not None))
    expect("op constants are distinct", len({hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product}) == 6)

    # ---- allreduce: every dtype and op, the four variants
    shape = (3, 5)
    for dtype in INTS + FLOATS:
        inputs = [make(r, shape, dtype) for r in everyone]
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            want = reference(op, inputs)
            what = f"allreduce {dtype} op={op}"
            mine = inputs[me].clone()
            same(what, hvd.allreduce(mine, op=op), want)
            same(what + " leaves its input", mine, inputs[me])
            out = hvd.allreduce_(mine, op=op)
            expect(what + "_ returns its tensor", out is mine)
            same(what + "_", mine, want)
            handle = hvd.allreduce_async(inputs[me], op=op, name=f"a.{dtype}.{op}")
            same(what + "_async", hvd.synchronize(handle), want)
            mine = inputs[me].clone()
            handle = hvd.allreduce_async_(mine, op=op)
            while not hvd.poll(handle):
                pass
            expect(what + "_async_ returns its tensor", hvd.synchronize(handle) is mine)
            same(what + "_async_", mine, want)
    x = make(me, (7,), torch.float32)
    inputs = [make(r, (7,), torch.float32) for r in everyone]
    same("allreduce average=True", hvd.allreduce(x, average=True), reference(hvd.Average, inputs))
    same("allreduce average=False", hvd.allreduce(x, average=False), reference(hvd.Sum, inputs))
    same("allreduce default is Average", hvd.allreduce(x), reference(hvd.Average, inputs))
    # Horovod's order: prescale, reduce, postscale, then Average's division.
    same("allreduce pre/postscale", hvd.allreduce(x, op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0),
         (reference(hvd.Sum, [t * 0.5 for t in inputs]) * 3.0 / n))
    xi = make(me, (7,), torch.int32) * 10
    want = (reference(hvd.Sum, [(t.double() * 0.5).trunc().to(torch.int32) for t in
                                [make(r, (7,), torch.int32) * 10 for r in everyone]]).double() * 3).trunc()
    same("allreduce int32 pre/postscale truncates", hvd.allreduce(xi, op=hvd.Sum, prescale_factor=0.5,
                                                                  postscale_factor=3.0), want.to(torch.int32))
    strided = make(me, (4, 6), torch.float64)[:, ::2]
    same("allreduce of a strided view", hvd.allreduce(strided, op=hvd.Sum),
         reference(hvd.Sum, [make(r, (4, 6), torch.float64)[:, ::2] for r in everyone]))
    # Differentiable: the gradient of allreduce(Sum) is the allreduced gradient.
    w = make(me, (4,), torch.float64).requires_grad_()
    (hvd.allreduce(w, op=hvd.Sum) * (me + 1)).sum().backward()
    same("allreduce backward", w.grad, torch.full((4,), float(sum(r + 1 for r in everyone)), dtype=torch.float64))

    # ---- grouped allreduce: mixed dtypes and shapes, in one call
    group_in = [make(me, (2, 3), torch.float32), make(me, (5,), torch.int64, 1), make(me, (4,), torch.float32, 2)]
    group_all = [[make(r, (2, 3), torch.float32), make(r, (5,), torch.int64, 1), make(r, (4,), torch.float32, 2)]
                 for r in everyone]
    for op in (hvd.Sum, hvd.Average, hvd.Max):
        wants = [reference(op, [g[i] for g in group_all]) for i in range(3)]
        for got, want in zip(hvd.grouped_allreduce(group_in, op=op), wants):
            same(f"grouped_allreduce op={op}", got, want)
        for got, want in zip(hvd.synchronize(hvd.grouped_allreduce_async(group_in, op=op)), wants):
            same(f"grouped_allreduce_async op={op}", got, want)
        copies = [t.clone() for t in group_in]
        out = hvd.grouped_allreduce_(copies, op=op)
        expect("grouped_allreduce_ returns its tensors", all(a is b for a, b in zip(out, copies)))
        for got, want in zip(copies, wants):
            same(f"grouped_allreduce_ op={op}", got, want)
        copies = [t.clone() for t in group_in]
        hvd.synchronize(hvd.grouped_allreduce_async_(copies, op=op))
        for got, want in zip(copies, wants):
            same(f"grouped_allreduce_async_ op={op}", got, want)

    # ---- broadcast: every root, dtypes cohort reduces and those it only moves
    for dtype in [torch.int8, torch.int64, torch.float16, torch.float32, torch.bool, torch.int16, torch.complex64]:
        for root in everyone:
            want = make(root, (3, 4), dtype, 5)
            mine = make(me, (3, 4), dtype, 5)
            same(f"broadcast {dtype} root {root}", hvd.broadcast(mine, root), want)
            same(f"broadcast {dtype} leaves its input", mine, make(me, (3, 4), dtype, 5))
            expect("broadcast_ returns its tensor", hvd.broadcast_(mine, root) is mine)
            same(f"broadcast_ {dtype} root {root}", mine, want)
            same(f"broadcast_async {dtype}", hvd.synchronize(hvd.broadcast_async(make(me, (3, 4), dtype, 5), root)),
                 want)
            mine = make(me, (3, 4), dtype, 5)
            hvd.synchronize(hvd.broadcast_async_(mine, root))
            same(f"broadcast_async_ {dtype}", mine, want)
    scalar = torch.tensor(float(me + 1))
    same("broadcast of a 0-dim tensor", hvd.broadcast(scalar, n - 1), torch.tensor(float(n)))
    w = make(me, (3,), torch.float64).requires_grad_()
    hvd.broadcast(w, 0).sum().backward()
    same("broadcast backward", w.grad, torch.full((3,), float(n) if me == 0 else 0.0, dtype=torch.float64))

    # ---- allgather: first dimensions that differ between ranks, and equal ones
    for dtype in [torch.uint8, torch.int32, torch.bfloat16, torch.float64, torch.bool, torch.int16]:
        parts = [make(r, (r + 1, 3), dtype, 2) for r in everyone]
        same(f"allgather uneven {dtype}", hvd.allgather(parts[me]), torch.cat(parts))
        same(f"allgather_async uneven {dtype}", hvd.synchronize(hvd.allgather_async(parts[me])), torch.cat(parts))
        parts = [make(r, (2, 2), dtype, 3) for r in everyone]
        same(f"allgather even {dtype}", hvd.allgather(parts[me]), torch.cat(parts))
    same("allgather of 0-dim tensors", hvd.allgather(torch.tensor(me)), torch.arange(n))
    same("allgather of an empty block", hvd.allgather(torch.ones(me % 2, 2)),
         torch.ones(sum(r % 2 for r in everyone), 2))
    outs = hvd.grouped_allgather([torch.full((me + 1,), me), make(me, (1, 2), torch.float32)])
    same("grouped_allgather [0]", outs[0], torch.cat([torch.full((r + 1,), r) for r in everyone]))
    same("grouped_allgather [1]", outs[1], torch.cat([make(r, (1, 2), torch.float32) for r in everyone]))
    w = make(me, (me + 1, 2), torch.float64).requires_grad_()
    (hvd.allgather(w) * 2.0).sum().backward()
    same("allgather backward", w.grad, torch.full((me + 1, 2), 2.0 * n, dtype=torch.float64))

    # ---- alltoall: even split, splits as a list and as a tensor (rank r sends r+j+1 rows... to rank j)
    rows = [make(r, (2 * n, 3), torch.float32, 4) for r in everyone]
    want = torch.cat([rows[r][2 * me:2 * me + 2] for r in everyone])
    same("alltoall even", hvd.alltoall(rows[me]), want)
    same("alltoall_async even", hvd.synchronize(hvd.alltoall_async(rows[me])), want)

    def sends(r):
        return [(r + j) % 3 for j in everyone]

    data = [make(r, (sum(sends(r)) + 1, 2), torch.int64, 6) for r in everyone]  # one extra row stays home
    want = torch.cat([data[r][sum(sends(r)[:me]):sum(sends(r)[:me + 1])] for r in everyone])
    out, received = hvd.alltoall(data[me], splits=sends(me))
    same("alltoall splits (list)", out, want)
    same("alltoall received_splits", received, torch.tensor([sends(r)[me] for r in everyone], dtype=torch.int32))
    out, received = hvd.synchronize(hvd.alltoall_async(data[me], splits=torch.tensor(sends(me), dtype=torch.int32)))
    same("alltoall_async splits (tensor)", out, want)
    expect("alltoall received_splits keeps the splits' dtype", received.dtype == torch.int32)
    bools = [make(r, (n, 2), torch.bool, 1) for r in everyone]
    same("alltoall bool", hvd.alltoall(bools[me]), torch.cat([bools[r][me:me + 1] for r in everyone]))

    # ---- reducescatter: even and uneven rows (the first ranks get one more), Sum and Average
    for total in (2 * n, 2 * n + 1):
        counts = [total // n + (1 if r < total % n else 0) for r in everyone]
        start = sum(counts[:me])
        for dtype in (torch.float32, torch.int32):
            inputs = [make(r, (total, 3), dtype, 7) for r in everyone]
            for op in (hvd.Sum, hvd.Average):
                want = reference(op, inputs)[start:start + counts[me]]
                same(f"reducescatter rows={total} {dtype} op={op}", hvd.reducescatter(inputs[me], op=op), want)
                same(f"reducescatter_async rows={total} {dtype} op={op}",
                     hvd.synchronize(hvd.reducescatter_async(inputs[me], op=op)), want)
        inputs = [make(r, (total, 2), torch.float64, 8) for r in everyone]
        same(f"reducescatter default Average, scaled rows={total}",
             hvd.reducescatter(inputs[me], prescale_factor=2.0, postscale_factor=0.5),
             reference(hvd.Average, inputs)[start:start + counts[me]])
    outs = hvd.grouped_reducescatter([make(me, (n, 2), torch.float32), make(me, (2 * n,), torch.int64)], op=hvd.Sum)
    same("grouped_reducescatter [0]", outs[0], reference(hvd.Sum, [make(r, (n, 2), torch.float32)
                                                                      for r in everyone])[me:me + 1])
    same("grouped_reducescatter [1]", outs[1], reference(hvd.Sum, [make(r, (2 * n,), torch.int64)
                                                                      for r in everyone])[2 * me:2 * me + 2])

    # ---- process sets: the even ranks
    evens = hvd.add_process_set([r for r in everyone if r % 2 == 0])
    expect("process set size/included", evens.size() == len(range(0, n, 2)) and evens.included() == (me % 2 == 0))
    if me % 2 == 0:
        expect("process set rank", evens.rank() == me // 2)
        inputs = [make(r, (4,), torch.float32) for r in range(0, n, 2)]
        same("allreduce on a process set", hvd.allreduce(inputs[me // 2], op=hvd.Sum, process_set=evens),
             reference(hvd.Sum, inputs))
        same("allgather on a process set", hvd.allgather(torch.tensor([me]), process_set=evens),
             torch.arange(0, n, 2))
        same("broadcast on a process set (global root rank)",
             hvd.broadcast(torch.tensor([me]), root_rank=max(range(0, n, 2)), process_set=evens),
             torch.tensor([max(range(0, n, 2))]))
        hvd.barrier(process_set=evens)
    else:
        raises("an operation on a set without this rank", ValueError,
               lambda: hvd.allreduce(torch.ones(1), process_set=evens))
    hvd.barrier()

    # ---- join: every rank joins; all agree on the last one
    last = hvd.join()
    expect("join returns a rank", last in everyone)
    same("join agrees on every rank", hvd.allgather(torch.tensor([last])), torch.full((n,), last))

    # ---- errors: each raises on every rank, and the next operation works
    handle = hvd.allreduce_async(torch.ones(2), name="twice")
    raises("a second op in flight with the same name", ValueError,
           lambda: hvd.allreduce_async(torch.ones(2), name="twice"))
    same("the first one still completes", hvd.synchronize(handle), torch.ones(2))
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="twice"))  # the name is free again
    raises("Adasum", NotImplementedError, lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum))
    raises("op and average together", ValueError, lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum))
    raises("alltoall splits of the wrong length", ValueError, lambda: hvd.alltoall(torch.ones(n), splits=[1]))

    finished = hvd.allreduce_async(torch.full((2,), 2.0), op=hvd.Sum)
    while not hvd.poll(finished):
        pass
    settle("sizes")
    message = raises("allreduce of different sizes", hvd.HorovodInternalError,
                     lambda: hvd.allreduce(torch.ones(3 + me)))
    same("a handle finished before the mismatch keeps its result", hvd.synchronize(finished),
         torch.full((2,), 2.0 * n))
    # (Which pair of ranks it names depends on who meets whom first: the counts are 3 + rank.)
    expect(f"the mismatch names the counts: {message}", "mismatched calls" in message
           and any(f"count={3 + r}" in message for r in everyone if r != me))
    same("allreduce after the mismatch", hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
    settle("dtypes")
    message = raises("allreduce of different dtypes", hvd.HorovodInternalError,
                     lambda: hvd.allreduce(torch.ones(4, dtype=torch.float32 if me == 0 else torch.float64)))
    expect(f"dtype mismatch message: {message}", "mismatched calls" in message)
    message = raises("broadcast from different roots", hvd.HorovodInternalError,
                     lambda: hvd.broadcast(torch.ones(4), root_rank=me))
    expect(f"root mismatch message: {message}", "root_rank=0" in message and "root_rank=1" in message)
    message = raises("broadcast of different shapes", hvd.HorovodInternalError,
                     lambda: hvd.broadcast(torch.ones(2, 1 + (me == 1)), root_rank=0))
    expect(f"broadcast shape mismatch message: {message}", "float32[2, 2]" in message)
    message = raises("allgather of different trailing dimensions", hvd.HorovodInternalError,
                     lambda: hvd.allgather(torch.ones(2, 2 + (me == n - 1))))
    expect(f"allgather mismatch names both shapes: {message}", f"rank {n - 1} of the process set has float32[2, 3]"
           in message and "rank 0 has float32[2, 2]" in message)
    message = raises("alltoall of different dtypes", hvd.HorovodInternalError,
                     lambda: hvd.alltoall(torch.ones(n, dtype=torch.float32 if me == 0 else torch.int32)))
    expect(f"alltoall mismatch message: {message}", "mismatched tensors" in message)
    # The process set survived the rebuilds after the mismatches.
    if me % 2 == 0:
        same("process set after the mismatches", hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=evens),
             torch.full((1,), float(len(range(0, n, 2)))))
    # A mismatch inside a process set: its ranks raise; the set cannot be rebuilt without the others
    # (torch builds groups with every rank), but the world goes on.
    settle("process set")
    if me % 2 == 0:
        message = raises("a mismatch inside a process set", hvd.HorovodInternalError,
                         lambda: hvd.allreduce(torch.ones(3 + me), process_set=evens))
        expect(f"the set's failure says so: {message}", "failed for good" in message)
    same("allreduce after every error", hvd.allreduce(torch.full((3,), float(me)), op=hvd.Max),
         torch.full((3,), float(n - 1)))

    # ---- shutdown, and a second init in the same job
    hvd.shutdown()
    expect("shutdown", not hvd.is_initialized())
    raises("rank() before init", ValueError, hvd.rank)
    hvd.init()
    same("allreduce after a second init", hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(n)))
    hvd.shutdown()
    print(f"OK {checks}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
