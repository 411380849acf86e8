"""Horovod's helper functions over the collectives of `.mpi_ops`: broadcast_parameters,
broadcast_optimizer_state, broadcast_object and allgather_object.

Each is built from Horovod's own collectives (`broadcast_async_`, `allgather`, ...), so it behaves
like them: every rank of the process set must call it, in the same order.
"""
import io
import pickle

import torch

from .mpi_ops import allgather, broadcast_, broadcast_async_, global_process_set, rank, synchronize

try:  # Horovod pickles with cloudpickle, which also takes lambdas and local classes; pickle otherwise.
    import cloudpickle as _pickler
except ImportError:
    _pickler = pickle


def _to_bytes_tensor(obj):
    buffer = io.BytesIO()
    _pickler.dump(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes_tensor(tensor):
    return pickle.loads(tensor.numpy().tobytes())


def broadcast_parameters(params, root_rank):
    """Overwrites, in place, every tensor of `params` with root_rank's.

    `params` is a `model.state_dict()` (a dict: broadcast in the order of its sorted names, so every
    rank pairs the same tensors), or a list or iterable of tensors or of (name, tensor) pairs, such as
    `model.parameters()` or `model.named_parameters()`. All broadcasts are started before the first is
    waited for.
    """
    if isinstance(params, dict):
        named = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        named = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"broadcast_parameters: params must be a dict (a state_dict) or a list of tensors "
                         f"or of (name, tensor) pairs, not {type(params).__name__}")
    handles = [broadcast_async_(tensor, root_rank, name) for name, tensor in named]
    for handle in handles:
        synchronize(handle)


def _initialize_optimizer_state(optimizer):
    """Creates the optimizer's state (momentum buffers, Adam's moments, ...) as its first step would,
    so that every rank has tensors for the root's to land in.

    Like Horovod, it runs one step of the wrapped optimizer on zero gradients (Adam's step count
    becomes 1, as with Horovod). Unlike Horovod, it then puts the parameters and their gradients back
    as they were, so that the step cannot move a parameter (weight decay on a zero gradient would).
    """
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                saved.append((p, p.detach().clone(), p.grad))
                p.grad = torch.zeros_like(p)
    from .optimizer import _DistributedOptimizer
    if isinstance(optimizer, _DistributedOptimizer):
        # The wrapped optimizer's own step: a DistributedOptimizer's would start allreduces, which
        # only work if every rank steps here, and need not happen.
        super(_DistributedOptimizer, optimizer).step()
    else:
        optimizer.step()
    with torch.no_grad():
        for p, value, grad in saved:
            p.copy_(value)
            p.grad = grad


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Makes every rank's optimizer state (its param_groups' options, such as the learning rate, and
    its per-parameter state, such as momentum buffers) root_rank's.

    An optimizer that has no state yet gets it first (see _initialize_optimizer_state). The root then
    sends a description of its state (the options, the non-tensor entries, and each tensor's place,
    shape and dtype); a rank whose state lacks a tensor, or holds one of another shape or dtype, makes
    a new one there. Then every tensor is broadcast in place. `model` is accepted for Horovod's
    signature; sparse gradients are not handled.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state: torch.optim.LBFGS's state cannot be broadcast "
                         "(its history is nested lists of tensors); broadcast_object(optimizer.state_dict()) "
                         "and load_state_dict instead")
    if len(optimizer.state) == 0:
        _initialize_optimizer_state(optimizer)

    # Places are (group index, parameter index within the group, state key): the same on every rank
    # of one model, unlike the parameters' ids.
    options = {}
    entries = {}
    for g, group in enumerate(optimizer.param_groups):
        options[g] = {k: v for k, v in group.items() if k != "params"}
        for i, p in enumerate(group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                entries[(g, i, key)] = value
    description = None
    if rank() == root_rank:
        description = {
            "options": options,
            "scalars": {place: v for place, v in entries.items() if not torch.is_tensor(v)},
            "tensors": [(place, tuple(v.shape), v.dtype) for place, v in entries.items() if torch.is_tensor(v)],
        }
    description = broadcast_object(description, root_rank, name="broadcast_optimizer_state")

    if len(description["options"]) != len(optimizer.param_groups):
        raise ValueError(f"broadcast_optimizer_state: rank {rank()} has {len(optimizer.param_groups)} parameter "
                         f"groups, rank {root_rank} has {len(description['options'])}")
    for g, group_options in description["options"].items():
        optimizer.param_groups[g].update(group_options)

    def parameter(g, i):
        params = optimizer.param_groups[g]["params"]
        if i >= len(params):
            raise ValueError(f"broadcast_optimizer_state: rank {root_rank}'s optimizer has state for parameter "
                             f"{i} of group {g}; rank {rank()}'s group has {len(params)} parameters")
        return params[i]

    for (g, i, key), value in description["scalars"].items():
        optimizer.state[parameter(g, i)][key] = value
    to_broadcast = []
    for (g, i, key), shape, dtype in description["tensors"]:
        state = optimizer.state[parameter(g, i)]
        mine = state.get(key)
        if not torch.is_tensor(mine) or tuple(mine.shape) != shape or mine.dtype != dtype:
            mine = state[key] = torch.empty(shape, dtype=dtype, device=parameter(g, i).device)
        to_broadcast.append((f"optimizer_state.{g}.{i}.{key}", mine))
    broadcast_parameters(to_broadcast, root_rank)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Returns root_rank's `obj` on every rank (pickled there, broadcast as bytes, unpickled here).

    The default name is the same on every rank (Horovod's is the object's type name, which differs
    when only the root passes an object and the others None)."""
    name = name or "broadcast_object"
    if rank() == root_rank:
        payload = _to_bytes_tensor(obj)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, name=f"{name}.size", process_set=process_set)
    if rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, name=f"{name}.bytes", process_set=process_set)
    return obj if rank() == root_rank else _from_bytes_tensor(payload)


def allgather_object(obj, name=None):
    """Returns the list of every rank's `obj`, in rank order."""
    name = name or "allgather_object"
    payload = _to_bytes_tensor(obj)
    lengths = allgather(torch.tensor([payload.numel()], dtype=torch.int64), name=f"{name}.size").tolist()
    gathered = allgather(payload, name=f"{name}.bytes")
    objects, start = [], 0
    for length in lengths:
        objects.append(_from_bytes_tensor(gathered[start:start + length]))
        start += length
    return objects
