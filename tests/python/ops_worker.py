"""One rank of the operations test: every collective on a cohort group and on a gloo group with
the same inputs; the results must match (exactly for integers, within tolerance for floats).

--init env:   default group gloo via env:// (MASTER_ADDR/PORT, RANK, WORLD_SIZE), cohort group
              built with new_group(backend="cohort").
--init store: default group cohort built on an explicit TCPStore passed to init_process_group,
              gloo group with new_group(backend="gloo").
Prints "OK <checks>" on success; any mismatch raises (non-zero exit).
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist

import cohort_torch  # noqa: F401  (registers backend "cohort")

DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]
OPS = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}

checks = 0


def make(rank, n, dtype, salt=0):
    """Deterministic per-rank input; integers stay in 1..5 so products fit in int8."""
    i = torch.arange(n, dtype=torch.float64)
    if dtype.is_floating_point:
        return (torch.sin(i * 0.37 + rank * 1.3 + salt) * 4.0).to(dtype)
    return ((torch.arange(n) + rank * 7 + salt) % 5 + 1).to(dtype)


def same(name, got, want):
    global checks
    checks += 1
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype.is_floating_point:
        tol = TOL[got.dtype]
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=name)
    else:
        assert torch.equal(got, want), f"{name}: {got} != {want}"


def both(fn, *tensors):
    """Runs fn(group, *clones) on the cohort group and on the gloo group; returns both clone sets."""
    a = [t.clone() for t in tensors]
    b = [t.clone() for t in tensors]
    fn(COHORT, *a)
    fn(GLOO, *b)
    return a, b


def local_reduce(tensors, op):
    acc = tensors[0].double()
    for t in tensors[1:]:
        t = t.double()
        acc = {dist.ReduceOp.SUM: acc + t, dist.ReduceOp.PRODUCT: acc * t,
               dist.ReduceOp.MIN: torch.minimum(acc, t), dist.ReduceOp.MAX: torch.maximum(acc, t)}[op]
    return acc


def test_allreduce(rank, world):
    for dtype in DTYPES:
        for n in ([1, 7, 1000, 65537] if dtype in (torch.float32, torch.int32) else [1000]):
            for op in OPS:
                x = make(rank, n, dtype)
                mine = x.clone()
                dist.all_reduce(mine, op=op, group=COHORT)
                ref = x.clone()
                try:
                    dist.all_reduce(ref, op=op, group=GLOO)
                except RuntimeError:
                    # gloo lacks this dtype/op: compare with the reduction done here in float64
                    ref = local_reduce([make(r, n, dtype) for r in range(world)], op).to(dtype)
                same(f"all_reduce {dtype} n={n} {op}", mine, ref)
        if dtype.is_floating_point:
            # gloo refuses AVG; it is SUM / world_size.
            x = make(rank, 1000, dtype)
            mine = x.clone()
            dist.all_reduce(mine, op=dist.ReduceOp.AVG, group=COHORT)
            ref = local_reduce([make(r, 1000, dtype) for r in range(world)], dist.ReduceOp.SUM)
            if dtype != torch.bfloat16:  # gloo 1.13 has no bfloat16
                ref = x.clone()
                dist.all_reduce(ref, op=dist.ReduceOp.SUM, group=GLOO)
            same(f"all_reduce AVG {dtype}", mine, (ref.double() / world).to(dtype))
        else:
            try:
                dist.all_reduce(make(rank, 4, dtype), op=dist.ReduceOp.AVG, group=COHORT)
                raise AssertionError("AVG on an integer tensor should be refused")
            except RuntimeError as e:
                assert "AVG" in str(e), str(e)


def test_other_collectives(rank, world):
    # gloo in torch 1.13 has no bfloat16 at all ("Invalid scalar type"): bfloat16 is checked
    # against the known inputs below.
    for dtype in (torch.int64, torch.float32, torch.float16, torch.uint8):
        x = make(rank, 1000, dtype)
        # broadcast from the last rank
        a, b = both(lambda g, t: dist.broadcast(t, src=world - 1, group=g), x)
        same(f"broadcast {dtype}", a[0], b[0])
        # reduce to rank 1 (only the root's result is defined)
        a, b = both(lambda g, t: dist.reduce(t, dst=1, op=dist.ReduceOp.SUM, group=g), x)
        if rank == 1:
            same(f"reduce {dtype}", a[0], b[0])
        # all_gather (list)
        outs_c = [torch.empty_like(x) for _ in range(world)]
        outs_g = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs_c, x, group=COHORT)
        dist.all_gather(outs_g, x, group=GLOO)
        for r in range(world):
            same(f"all_gather {dtype} [{r}]", outs_c[r], outs_g[r])
        # all_gather into one tensor
        big_c = torch.empty(world * 1000, dtype=dtype)
        dist.all_gather_into_tensor(big_c, x, group=COHORT)
        same(f"all_gather_into_tensor {dtype}", big_c, torch.cat(outs_g))
        # gather to rank 0
        gl_c = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
        gl_g = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
        dist.gather(x, gl_c, dst=0, group=COHORT)
        dist.gather(x, gl_g, dst=0, group=GLOO)
        if rank == 0:
            for r in range(world):
                same(f"gather {dtype} [{r}]", gl_c[r], gl_g[r])
        # scatter from rank 1
        src = [make(r + 10, 1000, dtype) for r in range(world)] if rank == 1 else None
        out_c, out_g = torch.empty_like(x), torch.empty_like(x)
        dist.scatter(out_c, src, src=1, group=COHORT)
        dist.scatter(out_g, [t.clone() for t in src] if src else None, src=1, group=GLOO)
        same(f"scatter {dtype}", out_c, out_g)
        same(f"scatter {dtype} vs source", out_c, make(rank + 10, 1000, dtype))
        # all_to_all_single, equal splits
        inp = make(rank, world * 300, dtype)
        o_c, o_g = torch.empty_like(inp), torch.empty_like(inp)
        dist.all_to_all_single(o_c, inp, group=COHORT)
        dist.all_to_all_single(o_g, inp, group=GLOO)
        same(f"all_to_all_single {dtype}", o_c, o_g)
        # all_to_all_single with uneven splits along dim 0 of a 2-D tensor
        in_splits = [(rank + r) % 3 + 1 for r in range(world)]
        out_splits = [(r + rank) % 3 + 1 for r in range(world)]
        inp2 = make(rank, sum(in_splits) * 5, dtype).view(-1, 5)
        o_c = torch.empty(sum(out_splits), 5, dtype=dtype)
        o_g = torch.empty_like(o_c)
        dist.all_to_all_single(o_c, inp2, out_splits, in_splits, group=COHORT)
        dist.all_to_all_single(o_g, inp2, out_splits, in_splits, group=GLOO)
        same(f"all_to_all_single uneven {dtype}", o_c, o_g)
    bf = make(rank, 999, torch.bfloat16)
    dist.broadcast(bf, src=world - 1, group=COHORT)
    same("broadcast bfloat16", bf, make(world - 1, 999, torch.bfloat16))
    outs = [torch.empty(999, dtype=torch.bfloat16) for _ in range(world)]
    dist.all_gather(outs, make(rank, 999, torch.bfloat16), group=COHORT)
    for r in range(world):
        same(f"all_gather bfloat16 [{r}]", outs[r], make(r, 999, torch.bfloat16))
    # Reductions onto blocks (gloo 1.13 has no reduce_scatter; the reference is computed here).
    for dtype in (torch.int32, torch.float32, torch.float16):
        ins = [make(rank, 100, dtype, salt=r) for r in range(world)]
        out = torch.empty(100, dtype=dtype)
        dist.reduce_scatter(out, ins, op=dist.ReduceOp.SUM, group=COHORT)
        want = local_reduce([make(r, 100, dtype, salt=rank) for r in range(world)],
                            dist.ReduceOp.SUM).to(dtype)
        same(f"reduce_scatter {dtype}", out, want)
        flat = torch.cat(ins)
        out2 = torch.empty(100, dtype=dtype)
        dist.reduce_scatter_tensor(out2, flat, op=dist.ReduceOp.MAX, group=COHORT)
        want = local_reduce([make(r, 100, dtype, salt=rank) for r in range(world)],
                            dist.ReduceOp.MAX).to(dtype)
        same(f"reduce_scatter_tensor MAX {dtype}", out2, want)
    # all_to_all with lists of different sizes (gloo 1.13 has no all_to_all: rank r sent us
    # make(r, 10 + rank + r))
    ins = [make(rank, 10 + r + rank, torch.float64) for r in range(world)]
    outs_c = [torch.empty(10 + rank + r, dtype=torch.float64) for r in range(world)]
    dist.all_to_all(outs_c, ins, group=COHORT)
    for r in range(world):
        same(f"all_to_all [{r}]", outs_c[r], make(r, 10 + rank + r, torch.float64))
    # coalesced allreduce of tensors with different shapes
    ts = [make(rank, 10, torch.float32).view(2, 5), make(rank, 33, torch.float32, salt=1)]
    tc = [t.clone() for t in ts]
    tg = [t.clone() for t in ts]
    dist.all_reduce_coalesced(tc, group=COHORT)
    dist.all_reduce_coalesced(tg, group=GLOO)
    for i in range(len(ts)):
        same(f"all_reduce_coalesced [{i}]", tc[i], tg[i])
    dist.barrier(group=COHORT)


def test_noncontiguous_async_p2p_errors(rank, world):
    # A strided view: staged through a contiguous copy and copied back into the view.
    # (gloo in torch 1.13 silently reduces the wrong elements of a strided view, so the
    # reference is computed here: only the view's columns change, to the sum over ranks.)
    base_c = make(rank, 80, torch.float32).view(8, 10)
    dist.all_reduce(base_c[:, ::3], group=COHORT)
    want = make(rank, 80, torch.float32).view(8, 10)
    want[:, ::3] = local_reduce([make(r, 80, torch.float32).view(8, 10)[:, ::3]
                                 for r in range(world)], dist.ReduceOp.SUM).float()
    same("all_reduce non-contiguous", base_c, want)
    t_c = make(rank, 12, torch.int64).view(3, 4).t()
    t_g = t_c.clone()
    dist.broadcast(t_c, src=0, group=COHORT)
    dist.broadcast(t_g, src=0, group=GLOO)
    same("broadcast transposed", t_c, t_g)
    # Work handle and future
    x = make(rank, 4096, torch.float32)
    work = dist.all_reduce(x, group=COHORT, async_op=True)
    assert work.wait(), "wait() should return True"
    # (Work.exception() is not convertible to Python in torch 1.13, for gloo as well.)
    assert work.is_completed() and work.is_success()
    fut = work.get_future()
    (result,) = fut.wait()
    ref = make(rank, 4096, torch.float32)
    dist.all_reduce(ref, group=GLOO)
    same("async all_reduce", x, ref)
    same("future value", result, ref)
    chained = dist.all_reduce(make(rank, 16, torch.float32), group=COHORT, async_op=True) \
        .get_future().then(lambda f: f.value()[0] * 2)
    ref = make(rank, 16, torch.float32)
    dist.all_reduce(ref, group=GLOO)
    same("future.then", chained.wait(), ref * 2)
    # send / recv (blocking and isend/irecv) around the ring
    peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        dist.send(make(rank, 500, torch.float64), dst=peer_next, group=COHORT)
        got = torch.empty(500, dtype=torch.float64)
        dist.recv(got, src=peer_prev, group=COHORT)
    else:
        got = torch.empty(500, dtype=torch.float64)
        dist.recv(got, src=peer_prev, group=COHORT)
        dist.send(make(rank, 500, torch.float64), dst=peer_next, group=COHORT)
    same("send/recv", got, make(peer_prev, 500, torch.float64))
    if rank == 0:
        w = dist.isend(make(rank, 64, torch.int32), dst=1, group=COHORT, tag=7)
        w.wait()
    elif rank == 1:
        got = torch.empty(64, dtype=torch.int32)
        dist.irecv(got, src=0, group=COHORT, tag=7).wait()
        same("isend/irecv", got, make(0, 64, torch.int32))
    # Refusals are immediate, clear RuntimeErrors (and leave the group usable).
    for bad, words in ((torch.ones(3, dtype=torch.bool), "does not support dtype"),
                       (torch.ones(3, dtype=torch.int16), "does not support dtype")):
        try:
            dist.all_reduce(bad, group=COHORT)
            raise AssertionError(f"{bad.dtype} should be refused")
        except RuntimeError as e:
            assert words in str(e), str(e)
    try:
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND, group=COHORT)
        raise AssertionError("BAND should be refused")
    except RuntimeError as e:
        assert "does not support reduce op" in str(e), str(e)
    # complex tensors: torch.distributed itself reduces them as a float view (SUM only)
    z = torch.full((4,), complex(1.0, float(rank)), dtype=torch.complex64)
    dist.all_reduce(z, group=COHORT)
    same("all_reduce complex64 (as float view)", torch.view_as_real(z),
         torch.view_as_real(torch.full((4,), complex(world, sum(range(world))),
                                       dtype=torch.complex64)))
    x = torch.ones(5)
    dist.all_reduce(x, group=COHORT)
    same("usable after refusals", x, torch.full((5,), float(world)))


def test_shared_storage(rank, world):
    """A tensor all_reduced again and again moves into memory the peers map (after its second large
    all_reduce); values stay equal to gloo's, views follow, borrowed memory (numpy) never moves, and
    ranks whose tensors sit at different offsets fall back to staging instead of failing."""
    local = os.environ.get("COHORT_TRANSPORT", "auto") != "tcp"
    n = 1 << 18  # 1 MiB of float32: above the 256 KiB threshold
    t = make(rank, n, torch.float32)
    view = t[5:9]
    pointers = []
    for salt in range(4):
        t.copy_(make(rank, n, torch.float32, salt))
        ref = t.clone()
        dist.all_reduce(t, group=COHORT)
        dist.all_reduce(ref, group=GLOO)
        same(f"reused all_reduce #{salt}", t, ref)
        same(f"view of a reused tensor #{salt}", view, ref[5:9])
        pointers.append(t.data_ptr())
    if local:
        assert pointers[0] != pointers[1] and pointers[1] == pointers[2] == pointers[3], \
            f"expected the storage to move once, at the second all_reduce: {pointers}"
    # AVG on the moved storage (the in-place path).
    t.copy_(make(rank, n, torch.float32, 9))
    ref = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=COHORT)
    dist.all_reduce(ref, group=GLOO)
    same("AVG on a moved tensor", t, ref / world)
    # A raw pointer taken before the move (here numpy's view of torch's memory) stays valid: it keeps
    # the memory of before the move, holding the result of the call that moved it.
    import numpy as np
    u = make(rank, n, torch.float32)
    before = u.numpy()
    dist.all_reduce(u, group=COHORT)
    dist.all_reduce(u, group=COHORT)  # moves (when local)
    snapshot = u.clone()
    churn = [torch.full((n,), 7.0) for _ in range(4)]  # would reuse freed memory
    dist.all_reduce(u, group=COHORT)
    if local:
        assert np.array_equal(before, snapshot.numpy()), "the pre-move memory must be kept, unchanged"
        assert not torch.equal(u, snapshot), "the moved tensor must see the later all_reduce"
    else:  # nothing moved: numpy's view is the tensor
        assert np.array_equal(before, u.numpy())
    del churn
    # numpy's memory is borrowed: never moved, still reduced right.
    a = np.full(n, rank + 1.0, dtype=np.float32)
    x = torch.from_numpy(a)
    for _ in range(3):
        dist.all_reduce(x, group=COHORT)
    assert x.data_ptr() == a.ctypes.data, "a numpy-backed tensor must keep numpy's memory"
    same("numpy-backed all_reduce", torch.from_numpy(a[:4].copy()),
         torch.full((4,), float(sum(range(1, world + 1)) * world ** 2)))
    # The ranks disagree: both move a reused tensor, then rank 1 switches to a fresh one while rank 0
    # keeps its moved one (staged, no error), and when rank 1 reuses its new tensor both move again
    # (rank 0's tensor a second time), so that their tensors line up and run in place again.
    a = make(rank, n, torch.float32)
    for _ in range(2):
        dist.all_reduce(a, group=COHORT)
    moved_a = a.data_ptr()
    b = make(rank, n, torch.float32)
    for salt in range(4):
        mine = a if rank == 0 else b
        mine.copy_(make(rank, n, torch.float32, salt))
        ref = mine.clone()
        before_call = mine.data_ptr()
        dist.all_reduce(mine, group=COHORT)
        dist.all_reduce(ref, group=GLOO)
        same(f"one rank on a moved tensor, the other not #{salt}", mine, ref)
        if local and salt == 0:
            assert mine.data_ptr() == before_call, "nothing moves while only one rank asks"
        if local and salt == 1:  # rank 1's tensor seen before, rank 0's moved: both ask, both move
            assert mine.data_ptr() != before_call, f"rank {rank}: expected a move at the second call"
    if local and rank == 0:
        assert a.data_ptr() != moved_a, "rank 0's tensor must have moved a second time"
    # Same sizes, different offsets into equal storages on different ranks.
    big = torch.zeros(n + 64)
    offset = 0 if rank == 0 else 16
    for salt in range(4):
        part = big[offset:offset + n]
        part.copy_(make(rank, n, torch.float32, salt))
        ref = part.clone()
        dist.all_reduce(part, group=COHORT)
        dist.all_reduce(ref, group=GLOO)
        same(f"different offsets #{salt}", part, ref)
    dist.barrier(group=COHORT)


def main():
    global COHORT, GLOO
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", choices=["env", "store"], default="env")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    if args.init == "env":
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        GLOO = dist.group.WORLD
        COHORT = dist.new_group(backend="cohort")
    else:
        try:  # torch >= 2.4: a torch built without libuv refuses the default (see dist_util.base_env)
            store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                                  timeout=timeout, use_libuv=False)
        except TypeError:  # torch 1.x has no use_libuv
            store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                                  timeout=timeout)
        dist.init_process_group("cohort", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        COHORT = dist.group.WORLD
        GLOO = dist.new_group(backend="gloo")
    assert dist.get_backend(COHORT) == "cohort", dist.get_backend(COHORT)
    test_allreduce(rank, world)
    test_other_collectives(rank, world)
    test_noncontiguous_async_p2p_errors(rank, world)
    test_shared_storage(rank, world)
    dist.barrier(group=GLOO)
    dist.destroy_process_group()
    print(f"OK {checks}")


if __name__ == "__main__":
    main()
