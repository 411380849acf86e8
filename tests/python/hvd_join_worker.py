"""One rank of the hvd.join() test (Horovod's uneven-data semantics), under `cohort run`.

argv[1] is the case:
  uneven    rank r trains STEPS[r] steps of a small model with DistributedOptimizer, then joins; the
            ranks that joined take part in the others' gradient allreduces with zeros. Every rank
            checks its weights against a reference computed here with torch alone (the averaged
            gradient counts a joined rank's as zeros and divides by the whole world), and prints
            join()'s answer, which must be the rank with the most steps, on every rank.
  refused   rank 1 joins at once; the others issue an allreduce (served), then a broadcast, an
            allgather and an alltoall, each of which must raise Horovod's "not supported with Join"
            error; then a barrier and an allreduce, and an allreduce_async left in flight across
            their own join().
  rounds    ROUNDS rounds of joins, with allreduces left in flight by the ranks that join last
            or not (which arrives last varies from round to round).
  silent    rank 1 joins; rank 0 neither issues nor joins for longer than the timeout: rank 1's
            join() must raise naming rank 0.
Prints "JOINED <last>" or the error's line; any failed check raises (non-zero exit).
"""
import sys
import time

import torch

import cohort.horovod.torch as hvd

STEPS = {0: 5, 1: 2, 2: 4}
ROUNDS = 30


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def grads(net, x, y):
    net.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    return [p.grad.clone() for p in net.parameters()]


def reference(n):
    """Every rank's weights after max(STEPS) steps of SGD on the averaged gradients, with zeros for a
    rank that has run out of data, computed without any collective."""
    net = model()
    ranks = range(n)
    for step in range(max(STEPS[r] for r in ranks)):
        total = [torch.zeros_like(p) for p in net.parameters()]
        for r in ranks:
            if step < STEPS[r]:
                for t, g in zip(total, grads(net, *batch(r, step))):
                    t += g
        with torch.no_grad():
            for p, t in zip(net.parameters(), total):
                p -= 0.1 * t / n
    return net


def uneven():
    n, me = hvd.size(), hvd.rank()
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    for step in range(STEPS[me]):
        opt.zero_grad()
        x, y = batch(me, step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    last = hvd.join()
    ref = reference(n)
    if me == max(range(n), key=lambda r: STEPS[r]):
        # The rank that trained longest ran every step: its weights are the reference's.
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            if not torch.allclose(p, q, atol=1e-6):
                raise AssertionError(f"rank {me}: {name} differs from the reference by "
                                     f"{(p - q).abs().max().item():g}")
    # After join every rank can go on: one more allreduce with everyone.
    total = hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum)
    assert total.item() == sum(range(n)), total
    print(f"rank {me} JOINED {last}", flush=True)


def refused():
    n, me = hvd.size(), hvd.rank()
    if me == 1:
        print(f"rank {me} JOINED {hvd.join()}", flush=True)
        return
    got = hvd.allreduce(torch.full((4,), float(me + 1)), op=hvd.Average)
    # The joined rank's zeros count, and Average divides by the whole world (Horovod's divisor).
    expected = sum(r + 1 for r in range(n) if r != 1) / n
    assert torch.allclose(got, torch.full((4,), expected)), (got, expected)
    for what, call in (("Broadcast", lambda: hvd.broadcast(torch.ones(3), root_rank=0)),
                       ("Allgather", lambda: hvd.allgather(torch.ones(2, 3))),
                       ("Alltoall", lambda: hvd.alltoall(torch.ones(n * 2)))):
        try:
            call()
        except hvd.HorovodInternalError as e:
            assert f"{what} is not supported with Join at this time" in str(e), e
            print(f"rank {me} REFUSED {what}", flush=True)
        else:
            raise AssertionError(f"rank {me}: {what} while rank 1 is joined did not raise")
    # The refusals left the ranks in step: a barrier and an allreduce still meet the joined rank.
    hvd.barrier()
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    assert torch.equal(got, torch.full((2,), float(n - 1))), got
    # An allreduce still in flight when its rank joins: the joined rank takes part in it too, even when
    # the rank issuing it joins last, right after (its own publishing covers what its watcher has not).
    handle = hvd.allreduce_async(torch.full((3,), 2.0), op=hvd.Sum)
    last = hvd.join()
    got = hvd.synchronize(handle)
    assert torch.equal(got, torch.full((3,), 2.0 * (n - 1))), got
    print(f"rank {me} JOINED {last}", flush=True)


def rounds():
    """Many rounds of joins, each with rank 1 joining at once and the others joining right after
    starting an allreduce they leave in flight: whichever rank arrives last, every rank must take part
    in those allreduces, and every rank must name the same last rank."""
    n, me = hvd.size(), hvd.rank()
    for i in range(ROUNDS):
        hvd.barrier()
        if me == 1:
            last = hvd.join()
        else:
            handle = hvd.allreduce_async(torch.full((3,), 2.0), op=hvd.Sum)
            last = hvd.join()
            got = hvd.synchronize(handle)
            assert torch.equal(got, torch.full((3,), 2.0 * (n - 1))), (i, got)
        lasts = hvd.allgather(torch.tensor([last]))
        assert len(set(lasts.tolist())) == 1, (i, lasts)
    print(f"rank {me} ROUNDS {ROUNDS}", flush=True)


def silent(timeout):
    me = hvd.rank()
    if me == 1:
        try:
            hvd.join()
        except hvd.HorovodInternalError as e:
            print(f"rank {me} ERROR {e}", flush=True)
            return
        raise AssertionError("join() returned although rank 0 never joined")
    # Rank 0 stays away from every collective for longer than the timeout (by a margin for a loaded
    # machine), then leaves without joining.
    time.sleep(timeout + 4)


if __name__ == "__main__":
    hvd.init()
    case = sys.argv[1]
    if case == "uneven":
        uneven()
    elif case == "refused":
        refused()
    elif case == "rounds":
        rounds()
    else:
        silent(float(sys.argv[2]))
