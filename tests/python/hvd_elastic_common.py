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
