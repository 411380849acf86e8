"""One rank of the Horovod training-API checks (test_horovod_train.py starts 2 under `cohort run`).

Written as a Horovod user writes (`import ... as hvd`), against references computed on this rank
with plain torch and no communication (the same model trained on the whole batch in one process,
BatchNorm on the concatenated batch), and against torch's DDP over gloo. Every rank can build every rank's data (seeded), so each checks
its own results, and rank-specific values (the root's model, its optimizer state) are rebuilt locally.
All the checks run in one launch: starting the ranks (importing torch) costs far more than they do.

The last line is `OK <number of checks>`; any failure raises (the rank exits non-zero).
"""
import time
import warnings

import torch

import cohort.horovod.torch as hvd

checks = 0


def check(condition, what):
    global checks
    if not condition:
        raise AssertionError(f"rank {hvd.rank()}: {what}")
    checks += 1


def close(got, expected, what, rtol=1e-5, atol=1e-6):
    global checks
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: f"rank {hvd.rank()}: {what}: {m}")
    checks += 1


def raises(exception, fn, what):
    try:
        fn()
    except exception as e:
        check(True, what)
        return e
    raise AssertionError(f"rank {hvd.rank()}: {what}: {exception.__name__} was not raised")


def mlp(seed, unused_branch=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    if unused_branch:
        model.unused = torch.nn.Linear(4, 4)  # never called by forward: its gradient stays None
    return model


def global_batch(step, world, per_rank):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(world * per_rank, 8, generator=g), torch.randn(world * per_rank, 4, generator=g)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


# ---------------------------------------------------------------------------------------------
# DistributedOptimizer
# ---------------------------------------------------------------------------------------------

STEPS = 4
PER_RANK = 6  # samples per rank per backward pass


def train_distributed(passes, steps=STEPS, clip=None, unused_branch=False, **options):
    """STEPS steps of SGD with momentum through hvd.DistributedOptimizer, each step `passes` backward
    passes on this rank's part of a global batch; returns the model."""
    model = mlp(0, unused_branch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **options)
    check(isinstance(opt, torch.optim.SGD), "the DistributedOptimizer is still an SGD")
    r, n = hvd.rank(), hvd.size()
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = global_batch(step * passes + k, n, PER_RANK)
            loss_of(model, x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]).backward()
        if clip is None:
            opt.step()
        else:
            # pytorch_mnist-style: reduce, change the reduced gradients, then step without reducing again.
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
    return model


def train_reference(passes, steps=STEPS, clip=None, loss_scale=1.0, unused_branch=False):
    """The same training in one process on the whole batch: each pass's loss is the mean over every
    rank's samples, which is the average of the ranks' losses (loss_scale=size for op=Sum)."""
    model = mlp(0, unused_branch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = global_batch(step * passes + k, hvd.size(), PER_RANK)
            (loss_of(model, x, y) * loss_scale).backward()
        if unused_branch:
            # DistributedOptimizer reduces a missing gradient as zeros: the parameter then has a
            # zero gradient rather than None (plain SGD skips None).
            for p in model.unused.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def same_weights(model, reference, what, rtol=1e-5, atol=1e-6):
    initial = mlp(0).state_dict()
    for (name, got), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        close(got, expected, f"{what}: {name}", rtol=rtol, atol=atol)
    check(not torch.allclose(model.state_dict()["0.weight"], initial["0.weight"]), f"{what}: training moved the weights")


def train_ddp_gloo(passes, group, steps=STEPS):
    """The same training under torch's DistributedDataParallel over gloo (no_sync() for all passes
    but the last of each step, where DDP reduces the accumulated gradients)."""
    model = torch.nn.parallel.DistributedDataParallel(mlp(0), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    r, n = hvd.rank(), hvd.size()
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = global_batch(step * passes + k, n, PER_RANK)
            x, y = x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]
            if k < passes - 1:
                with model.no_sync():
                    loss_of(model, x, y).backward()
            else:
                loss_of(model, x, y).backward()
        opt.step()
    return model.module


def check_compression():
    x = torch.randn(5, dtype=torch.float64)
    sent, ctx = hvd.Compression.fp16.compress(x)
    check(sent.dtype == torch.float16, f"Compression.fp16 sends float16, not {sent.dtype}")
    back = hvd.Compression.fp16.decompress(sent, ctx)
    check(back.dtype == torch.float64, "Compression.fp16 gives back the original dtype")
    close(back, x, "Compression.fp16 round trip", rtol=1e-3, atol=1e-3)
    counts = torch.arange(4)
    sent, ctx = hvd.Compression.fp16.compress(counts)
    check(sent is counts and hvd.Compression.fp16.decompress(sent, ctx) is counts, "integers travel unchanged")
    sent, ctx = hvd.Compression.none.compress(x)
    check(sent is x and hvd.Compression.none.decompress(sent, ctx) is x, "Compression.none is the identity")
    # allreduce's own compression argument (mpi_ops) takes these compressors too.
    reduced = hvd.allreduce(torch.full((3,), float(hvd.rank() + 1)), compression=hvd.Compression.fp16, op=hvd.Sum)
    close(reduced, torch.full((3,), float(sum(range(1, hvd.size() + 1)))), "allreduce(compression=fp16)")
    check(reduced.dtype == torch.float32, "allreduce(compression=fp16) returns float32")


def check_distributed_optimizer():
    # hvd.init() made torch's default group a cohort one: gloo's group for DDP is built beside it.
    gloo = torch.distributed.new_group(backend="gloo")
    for passes in (1, 2):
        hvd_model = train_distributed(passes)
        same_weights(hvd_model, train_reference(passes), f"backward_passes_per_step={passes}")
        same_weights(hvd_model, train_ddp_gloo(passes, gloo), f"backward_passes_per_step={passes} against DDP over gloo")
    # fp16 compression: float16 carries about 3 significant digits of each gradient.
    fp16 = train_distributed(1, compression=hvd.Compression.fp16)
    same_weights(fp16, train_reference(1), "Compression.fp16", rtol=1e-2, atol=2e-3)
    exact = train_distributed(1)
    check(any(not torch.equal(a, b) for a, b in zip(fp16.state_dict().values(), exact.state_dict().values())),
          "Compression.fp16: the gradients really travelled as float16 (the weights differ from float32's)")
    same_weights(train_distributed(1, gradient_predivide_factor=2.0), train_reference(1), "gradient_predivide_factor=2")
    same_weights(train_distributed(1, op=hvd.Sum), train_reference(1, loss_scale=hvd.size()), "op=hvd.Sum")
    same_weights(train_distributed(2, groups=2), train_reference(2), "groups=2")
    model = mlp(0)
    listed = [[model[0].weight, model[4].bias], [model[2].weight, model[2].bias]]
    # groups as lists of parameters: train this very model (train_distributed builds its own).
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), groups=listed)
    r, n = hvd.rank(), hvd.size()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(step, n, PER_RANK)
        loss_of(model, x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]).backward()
        opt.step()
    same_weights(model, train_reference(1), "groups as lists of parameters")
    same_weights(train_distributed(1, clip=0.05), train_reference(1, clip=0.05),
                 "synchronize(), clip_grad_norm_, step() in skip_synchronize()")
    unused = train_distributed(1, unused_branch=True)
    same_weights(unused, train_reference(1, unused_branch=True), "a parameter without a gradient")


def check_ranks_with_different_graphs():
    """Rank 0's forward uses branch a, rank 1's branch b, of the same shapes. Horovod pairs the
    allreduces by name; cohort pairs them by order, which DistributedOptimizer's launch order keeps
    the same on every rank: a's gradient on rank 0 meets a's zeros on rank 1, never b's gradient.
    Three steps: the first in the reverse parameter order, the next in rank 0's learned order."""
    def model():
        torch.manual_seed(5)
        return torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8), "b": torch.nn.Linear(8, 8),
                                    "head": torch.nn.Linear(8, 4)})

    def forward(m, x, branch):
        return m["head"](torch.tanh(m[branch](x)))

    r, n = hvd.rank(), hvd.size()
    distributed, single = model(), model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(distributed.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=distributed.named_parameters())
    reference_opt = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    branches = "ab"
    for step in range(3):
        x, y = global_batch(step, n, PER_RANK)
        part = slice(r * PER_RANK, (r + 1) * PER_RANK)
        opt.zero_grad()
        torch.nn.functional.mse_loss(forward(distributed, x[part], branches[r]), y[part]).backward()
        opt.step()
        reference_opt.zero_grad()
        sum(torch.nn.functional.mse_loss(forward(single, x[k * PER_RANK:(k + 1) * PER_RANK], branches[k]),
                                         y[k * PER_RANK:(k + 1) * PER_RANK]) for k in range(n)).div(n).backward()
        reference_opt.step()
    for (name, got), (_, expected) in zip(distributed.state_dict().items(), single.state_dict().items()):
        close(got, expected, f"ranks using different branches: {name}")


def check_adasum():
    """op=hvd.Adasum: each rank steps SGD with momentum (its own momentum buffers) on its own gradient,
    and the parameters move by the Adasum of the ranks' changes. The reference simulates both ranks
    here: one model and one optimizer per rank, all starting each step from the shared parameters."""
    def adasum2(a, b):  # the Adasum paper's rule for two ranks, in float64
        a, b = a.double(), b.double()
        dot = (a * b).sum()
        return (1 - dot / (2 * (a * a).sum())) * a + (1 - dot / (2 * (b * b).sum())) * b

    r, n = hvd.rank(), hvd.size()
    model = mlp(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    shared = mlp(0)
    replicas = [mlp(0) for _ in range(n)]
    replica_opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in replicas]
    for step in range(3):
        x, y = global_batch(step, n, PER_RANK)
        opt.zero_grad()
        loss_of(model, x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]).backward()
        opt.step()
        deltas = []
        for k, (replica, replica_opt) in enumerate(zip(replicas, replica_opts)):
            replica.load_state_dict(shared.state_dict())
            replica_opt.zero_grad()
            loss_of(replica, x[k * PER_RANK:(k + 1) * PER_RANK], y[k * PER_RANK:(k + 1) * PER_RANK]).backward()
            replica_opt.step()
            deltas.append({name: v - shared.state_dict()[name] for name, v in replica.state_dict().items()})
        with torch.no_grad():
            for name, value in shared.state_dict().items():
                value.add_(adasum2(deltas[0][name], deltas[1][name]).to(value.dtype))
    for name, value in shared.state_dict().items():
        close(model.state_dict()[name], value, f"op=hvd.Adasum: {name}")
    plain_average = train_distributed(1, steps=3)
    check(any(not torch.allclose(a, b) for a, b in zip(model.state_dict().values(), plain_average.state_dict().values())),
          "op=hvd.Adasum differs from op=hvd.Average")
    raises(AssertionError, lambda: opt.skip_synchronize().__enter__(), "skip_synchronize() with Adasum raises")


def check_overlap():
    """An allreduce starts, and finishes, while backward is still running.

    The hook on the input's gradient runs inside loss.backward(), when autograd computes the
    gradient of the first layer's input: the last layer's gradients were ready long before. There,
    the last layer's allreduce must already have been started by its hook, and must complete (the
    communicator works on it in the background) while this thread is still inside backward.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    seen = {}

    def at_input_gradient(grad):
        # _handles: the optimizer's allreduces started so far, keyed by parameter, in start order.
        started = {opt._parameter_names[p]: handle for p, (handle, _) in opt._handles.items()}
        seen["started"] = list(started)
        if "4.weight" not in started:
            raise AssertionError(f"rank {hvd.rank()}: backward reached the input and the last layer's allreduce "
                                 f"had not started (started: {list(started)})")
        deadline = time.monotonic() + 10
        while not hvd.poll(started["4.weight"]):
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {hvd.rank()}: the last layer's allreduce did not complete within "
                                     "10 s while backward waited")
            time.sleep(0.0005)
        seen["completed_inside_backward"] = True
        return grad

    x = torch.randn(32, 64, requires_grad=True)
    x.register_hook(at_input_gradient)
    loss_of_last = model(x).square().mean()
    loss_of_last.backward()
    check(seen.get("completed_inside_backward"), "the input's gradient hook ran")
    # The output layer's gradients come first in backward, the first layer's weight last.
    check({"4.weight", "4.bias", "2.weight", "2.bias"} <= set(seen["started"]),
          f"allreduces started before backward reached the input: {seen['started']}")
    check("0.weight" not in seen["started"], f"the first layer's weight is reduced after its gradient: {seen['started']}")
    opt.step()
    print(f"overlap: started before backward ended: {seen['started']}", flush=True)

    # A model whose layers are registered in the reverse of the order it uses them: the first
    # step's launch order (the reverse of the parameters') is backward's reverse, so its allreduces
    # wait behind the last-ready gradient; from the second step on, the order learned from rank 0's
    # first backward lets them start during backward again.
    class Reordered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.last = torch.nn.Linear(256, 10)
            self.middle = torch.nn.Linear(256, 256)
            self.first = torch.nn.Linear(64, 256)

        def forward(self, x):
            return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))

    model = Reordered()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    started_by_step = []
    for step in range(2):
        x = torch.randn(32, 64, requires_grad=True)
        x.register_hook(lambda grad: started_by_step.append([opt._parameter_names[p] for p in opt._handles]))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    check({"last.weight", "last.bias", "middle.weight", "middle.bias"} <= set(started_by_step[1]),
          f"after the first step the learned order starts allreduces during backward: {started_by_step}")


def check_optimizer_errors():
    model = mlp(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = global_batch(0, hvd.size(), PER_RANK)
    loss_of(model, x, y).backward()
    error = raises(AssertionError, lambda: loss_of(model, x, y).backward(),
                   "a second backward with backward_passes_per_step=1 raises")
    check("backward_passes_per_step" in str(error), f"the error names backward_passes_per_step: {error}")
    raises(AssertionError, opt.zero_grad, "zero_grad() with allreduces in flight raises")
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    check(any("skip_synchronize" in str(w.message) for w in caught), "step() after synchronize() warns")
    opt.zero_grad()

    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    raises(ValueError, lambda: hvd.DistributedOptimizer(sgd(model), model.named_parameters(), op=hvd.Adasum, groups=2),
           "op=Adasum with groups is refused")
    twice = [("same", model[0].weight), ("same", model[0].bias)]
    raises(ValueError, lambda: hvd.DistributedOptimizer(sgd(model), twice), "repeated names are refused")
    raises(ValueError, lambda: hvd.DistributedOptimizer(sgd(model), list(model.named_parameters())[:2]),
           "parameters missing from named_parameters are refused")
    raises(ValueError, lambda: hvd.DistributedOptimizer(sgd(model), model.named_parameters(), op=hvd.Sum,
                                                        gradient_predivide_factor=2.0),
           "gradient_predivide_factor with op=Sum is refused")
    raises(ValueError, lambda: hvd.DistributedOptimizer(sgd(model), model.named_parameters(),
                                                        backward_passes_per_step=0),
           "backward_passes_per_step=0 is refused")


# ---------------------------------------------------------------------------------------------
# broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object
# ---------------------------------------------------------------------------------------------

def bn_model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    model[1].running_mean.normal_()
    model[1].num_batches_tracked.fill_(seed + 3)
    return model


def check_broadcasts():
    r = hvd.rank()
    model = bn_model(r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for name, value in bn_model(0).state_dict().items():
        close(model.state_dict()[name], value, f"broadcast_parameters(state_dict(), root 0): {name}", rtol=0, atol=0)
    model = bn_model(r)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=1)
    for (name, got), (_, expected) in zip(model.named_parameters(), bn_model(1).named_parameters()):
        close(got, expected, f"broadcast_parameters(named_parameters(), root 1): {name}", rtol=0, atol=0)
    close(model[1].running_mean, bn_model(r)[1].running_mean, "buffers are not parameters: left alone", rtol=0, atol=0)
    model = bn_model(r)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    close(model[2].weight, bn_model(0)[2].weight, "broadcast_parameters(list of tensors)", rtol=0, atol=0)

    # SGD with momentum, trained 2 steps differently on each rank, with rank-specific options.
    def trained_sgd(seed):
        model = bn_model(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * (seed + 1), momentum=0.5 + 0.1 * seed)
        for step in range(2):
            opt.zero_grad()
            torch.manual_seed(100 * seed + step)
            model(torch.randn(5, 8)).sum().backward()
            opt.step()
        return opt
    opt = trained_sgd(r)
    hvd.broadcast_optimizer_state(opt, root_rank=1)
    root = trained_sgd(1)
    check(opt.param_groups[0]["lr"] == root.param_groups[0]["lr"], "broadcast_optimizer_state: the learning rate")
    check(opt.param_groups[0]["momentum"] == root.param_groups[0]["momentum"], "broadcast_optimizer_state: momentum")
    for p, q in zip(opt.param_groups[0]["params"], root.param_groups[0]["params"]):
        close(opt.state[p]["momentum_buffer"], root.state[q]["momentum_buffer"],
              "broadcast_optimizer_state: momentum buffers", rtol=0, atol=0)

    # A fresh Adam (no state yet) on rank 0, one already stepped on rank 1, root 1: rank 0 gets its state.
    model = bn_model(0)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3 * (r + 1))
    if r == 1:
        model(torch.randn(5, 8)).sum().backward()
        adam.step()
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(adam, root_rank=1)
    check(adam.param_groups[0]["lr"] == 2e-3, "broadcast_optimizer_state(Adam): root 1's learning rate")
    check(all(len(adam.state[p]) > 0 for p in model.parameters()), "broadcast_optimizer_state(Adam): state everywhere")
    if r == 0:
        for p, b in zip(model.parameters(), before):
            close(p.detach(), b, "creating the state leaves the parameters as they were", rtol=0, atol=0)
    steps = hvd.allgather_object([float(adam.state[p]["step"]) for p in model.parameters()])
    check(steps[0] == steps[1], f"broadcast_optimizer_state(Adam): step counts {steps}")
    moments = hvd.allgather(torch.cat([adam.state[p]["exp_avg"].flatten() for p in model.parameters()]).unsqueeze(0))
    close(moments[0], moments[1], "broadcast_optimizer_state(Adam): first moments agree", rtol=0, atol=0)

    # pytorch_synthetic_benchmark's order: wrap first, then broadcast the (fresh) state of the
    # DistributedOptimizer: its state is created with the wrapped optimizer's step, no allreduce.
    model = bn_model(r)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    check(opt.param_groups[0]["lr"] == 0.1, "broadcast_optimizer_state(DistributedOptimizer): root 0's learning rate")
    check(all(p.grad is None for p in model.parameters()), "creating the state leaves the gradients as they were")
    check(all("momentum_buffer" in opt.state[p] for p in model.parameters()), "a DistributedOptimizer's state")
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    stepped = hvd.allgather(torch.cat([p.detach().flatten() for p in model.parameters()]).unsqueeze(0))
    close(stepped[0], stepped[1], "after a step of the DistributedOptimizer the ranks agree", rtol=0, atol=0)

    got = hvd.broadcast_object({"epoch": 7, "name": "root"} if r == 1 else None, root_rank=1)
    check(got == {"epoch": 7, "name": "root"}, f"broadcast_object from root 1: {got}")
    got = hvd.broadcast_object(torch.arange(r, r + 3), root_rank=0)
    close(got, torch.arange(0, 3), "broadcast_object of a tensor", rtol=0, atol=0)
    everyone = hvd.allgather_object({"rank": r, "payload": list(range(r * 50))})
    check(everyone == [{"rank": k, "payload": list(range(k * 50))} for k in range(hvd.size())],
          "allgather_object of objects of different sizes")


# ---------------------------------------------------------------------------------------------
# SyncBatchNorm
# ---------------------------------------------------------------------------------------------

def check_sync_batch_norm():
    r, n = hvd.rank(), hvd.size()
    sizes = [3 + 2 * k for k in range(n)]  # uneven batches: 3 and 5 samples
    start = sum(sizes[:r])
    cases = [("BatchNorm1d (N, C)", torch.nn.BatchNorm1d, (4,), {}),
             ("BatchNorm1d (N, C, L)", torch.nn.BatchNorm1d, (4, 7), {}),
             ("BatchNorm2d", torch.nn.BatchNorm2d, (3, 5, 5), {}),
             ("BatchNorm2d momentum=None", torch.nn.BatchNorm2d, (3, 4, 4), {"momentum": None}),
             ("BatchNorm3d affine=False", torch.nn.BatchNorm3d, (2, 3, 3, 3), {"affine": False})]
    for what, reference_class, shape, options in cases:
        g = torch.Generator().manual_seed(7)
        full = torch.randn(sum(sizes), *shape, generator=g) * 3 + 1
        upstream = torch.randn(sum(sizes), *shape, generator=g)
        reference = reference_class(shape[0], **options)
        sync = hvd.SyncBatchNorm(shape[0], **options)
        if reference.weight is not None:
            with torch.no_grad():
                reference.weight.copy_(torch.rand(shape[0], generator=g) + 0.5)
                reference.bias.copy_(torch.randn(shape[0], generator=g))
                sync.weight.copy_(reference.weight)
                sync.bias.copy_(reference.bias)
        for step in range(2):  # twice: the running statistics move twice
            x_full = full.clone().requires_grad_()
            (reference(x_full) * upstream).sum().backward()
            x = full[start:start + sizes[r]].clone().requires_grad_()
            out = sync(x)
            (out * upstream[start:start + sizes[r]]).sum().backward()
            with torch.no_grad():
                expected = torch.nn.functional.batch_norm(full, None, None, reference.weight, reference.bias, True,
                                                          0.0, reference.eps)
            close(out, expected[start:start + sizes[r]], f"{what}: output", rtol=1e-4, atol=1e-5)
            close(x.grad, x_full.grad[start:start + sizes[r]], f"{what}: input gradient", rtol=1e-4, atol=1e-5)
            if reference.weight is not None:
                # Each rank's parameter gradient is its share; their sum is the whole batch's.
                close(hvd.allreduce(sync.weight.grad, op=hvd.Sum), reference.weight.grad, f"{what}: weight gradient",
                      rtol=1e-4, atol=1e-4)
                close(hvd.allreduce(sync.bias.grad, op=hvd.Sum), reference.bias.grad, f"{what}: bias gradient",
                      rtol=1e-4, atol=1e-4)
                sync.zero_grad()
                reference.zero_grad()
            close(sync.running_mean, reference.running_mean, f"{what}: running mean", rtol=1e-5, atol=1e-6)
            close(sync.running_var, reference.running_var, f"{what}: running variance", rtol=1e-5, atol=1e-6)
            check(int(sync.num_batches_tracked) == int(reference.num_batches_tracked), f"{what}: batches tracked")
        sync.eval()
        reference.eval()
        close(sync(full[start:start + sizes[r]]), reference(full)[start:start + sizes[r]],
              f"{what}: eval mode uses the running statistics", rtol=1e-5, atol=1e-6)
    raises(ValueError, lambda: hvd.SyncBatchNorm(3)(torch.randn(3)), "a 1-D input is refused")

    # Together with DistributedOptimizer: a model with SyncBatchNorm trained on 2 ranks (each its half,
    # its own mean loss) ends as the model with BatchNorm trained in one process on the whole batch.
    def bn_mlp(norm):
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(8, 12), norm(12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
    distributed, single = bn_mlp(hvd.SyncBatchNorm), bn_mlp(torch.nn.BatchNorm1d)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(distributed.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=distributed.named_parameters())
    reference_opt = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = global_batch(step, n, PER_RANK)
        opt.zero_grad()
        loss_of(distributed, x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]).backward()
        opt.step()
        reference_opt.zero_grad()
        loss_of(single, x, y).backward()
        reference_opt.step()
    for (name, got), (_, expected) in zip(distributed.state_dict().items(), single.state_dict().items()):
        close(got, expected, f"SyncBatchNorm + DistributedOptimizer against BatchNorm in one process: {name}",
              rtol=1e-4, atol=1e-5)


def main():
    hvd.init()
    check(hvd.size() == 2, f"2 ranks expected, got {hvd.size()}")
    check_compression()
    check_distributed_optimizer()
    check_ranks_with_different_graphs()
    check_adasum()
    check_overlap()
    check_optimizer_errors()
    check_broadcasts()
    check_sync_batch_norm()
    hvd.shutdown()
    print(f"OK {checks}", flush=True)


if __name__ == "__main__":
    main()
