"""broadcast: root_rank's tensor on every rank, after one small exchange in which the ranks agree on
the root, dtype and shape; in place or not, blocking or with a handle, differentiable."""
import torch
import torch.distributed as dist

from .allreduce import _allreduce_now
from .handles import _start, _translate_errors, synchronize
from .join import _note, _refuse_if_joined
from .process_sets import _group_of, _set_size, global_process_set
from .state import HorovodInternalError, Sum, _state
from .tensors import _DTYPE_CODE, _all_gather_into, _as_wire, _check_tensor, _describe_row


def _check_root(root_rank, process_set, what):
    members = range(_state.size) if process_set in (None, global_process_set) else process_set.ranks
    if root_rank not in members:
        raise ValueError(f"{what}: root_rank {root_rank} is not a rank of the process set ({_set_size(process_set)} ranks)")


def _broadcast_start(tensor, output, root_rank, name, process_set, what):
    _check_tensor(tensor, what)
    group = _group_of(process_set)
    _check_root(root_rank, process_set, what)
    _agree_on_broadcast(tensor, root_rank, group, _set_size(process_set), what)
    if output is not tensor:
        output.copy_(tensor)
    wire = _as_wire(output)

    def launch():
        if group is _state.world_group:
            _note("x", "broadcast")
        return dist.broadcast(wire, root_rank, group=group, async_op=True)

    return _start(what, name, group, launch, lambda: output)


def _agree_on_broadcast(tensor, root_rank, group, n, what):
    """One small allgather of every rank's (root, dtype, shape) before the data moves: a broadcast whose
    ranks name different roots would otherwise pass unnoticed across hosts (each "root" only sends, so
    no rank receives a message whose signature could disagree). Raises the same error on every rank."""
    if n == 1:
        return
    slots = 11
    if tensor.dim() > slots - 3:
        raise ValueError(f"{what}: tensors of more than {slots - 3} dimensions are not supported")
    mine = torch.full((slots,), -1, dtype=torch.int64)
    mine[0] = root_rank
    mine[1] = _DTYPE_CODE.get(tensor.dtype, 99)
    mine[2] = tensor.dim()
    mine[3:3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    every = torch.empty(n, slots, dtype=torch.int64)
    if group is _state.world_group:
        _note("ag", slots)
    _translate_errors(what, group, _all_gather_into, every, mine, group)
    for r in range(1, n):
        if not torch.equal(every[r], every[0]):
            _refuse_if_joined(every, "Broadcast is not supported with Join at this time.", what)
            def text(row):
                return f"root_rank={int(row[0])} with {_describe_row(row[1:])}"
            raise HorovodInternalError(f"{what}: mismatched calls: rank {r} of the process set called it with "
                                       f"{text(every[r])} but its rank 0 with {text(every[0])}")


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts a broadcast of root_rank's `tensor` into a new tensor on every rank; returns a handle."""
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _broadcast_start(tensor, output, root_rank, name, process_set, "broadcast_async")


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts an in-place broadcast of root_rank's `tensor`; returns a handle."""
    if not tensor.is_contiguous():
        raise ValueError("broadcast_async_: the tensor must be contiguous")
    return _broadcast_start(tensor, tensor, root_rank, name, process_set, "broadcast_async_")


class _BroadcastGrad(torch.autograd.Function):
    """broadcast as an autograd function: the root's gradient is the sum of every rank's."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, process_set)
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        root_rank, ps = ctx.args
        summed = _allreduce_now(grad, None, None, Sum, 1.0, 1.0, ps, "broadcast (backward)")
        if _state.rank != root_rank:
            summed.zero_()
        return summed, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns root_rank's `tensor` on every rank; `tensor` is unchanged. Differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastGrad.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrites `tensor` with root_rank's on every rank and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))
