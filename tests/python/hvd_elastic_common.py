"""What the two elastic Horovod workers share: the data of a step and a fresh model with its optimizer,
both deterministic, so that a worker can replay the training it must have ended with."""
import torch


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def fresh():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def elastic_state(hvd):
    """A fresh model under hvd's DistributedOptimizer and the hvd.elastic state that carries it across
    generations: (model, optimizer, state at step 0)."""
    model, opt = fresh()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    return model, opt, hvd.elastic.TorchState(model, opt, step=0)


def train_step(model, opt, state, rank):
    """One step of this rank's batch; the caller commits (before or after its fault, as its test needs)."""
    x, y = batch(state.step, rank)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    state.step += 1


def expect_replayed(model, steps, ranks_at, what):
    """Asserts that `model` ends where one process ends that replays `steps` steps, averaging at each
    step the gradients of the ranks `ranks_at(step)` names, as the allreduce did."""
    ref, ref_opt = fresh()
    for step in range(steps):
        ranks = ranks_at(step)
        ref_opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(ref(x), y) for x, y in (batch(step, r) for r in ranks))
        (loss / len(ranks)).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6), f"{name}: {p} {what}, {q} in the replay"
