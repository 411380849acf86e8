"""allgather: the ranks' tensors concatenated along the first dimension, which may differ between
ranks (one small exchange of the shapes first); blocking or with a handle, differentiable, grouped."""
import torch

from .allreduce import _allreduce_now
from .handles import _start, _translate_errors, synchronize
from .join import _note, _refuse_if_joined
from .process_sets import _group_of, _set_rank, _set_size, global_process_set
from .state import HorovodInternalError, Sum, _state
from .tensors import _DTYPE_CODE, _all_gather_into, _as_wire, _check_tensor, _describe_row


def _exchange_shapes(tensor, group, n, what):
    """Every rank's shape, through one small allgather; raises the same error on every rank when the
    ranks' tensors differ in dtype, rank (number of dimensions) or any dimension but the first."""
    # [dtype code, ndim, dims...]: every rank sends the same width, so 8 dimensions at most.
    slots = 10
    if tensor.dim() > slots - 2:
        raise ValueError(f"{what}: tensors of more than {slots - 2} dimensions are not supported")
    mine = torch.full((slots,), -1, dtype=torch.int64)
    mine[0] = _DTYPE_CODE.get(tensor.dtype, 99)
    mine[1] = tensor.dim()
    mine[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    every = torch.empty(n, slots, dtype=torch.int64)
    if group is _state.world_group:
        _note("ag", slots)
    _translate_errors(what, group, _all_gather_into, every, mine, group)
    # Compared with the set's first rank, so that every rank names the same pair.
    first = every[0].clone()
    first[2] = -1
    for r in range(1, n):
        row = every[r].clone()
        row[2] = -1
        if not torch.equal(row, first):
            _refuse_if_joined(every, "Allgather is not supported with Join at this time. "
                                     "Specify sparse_to_dense=True if using DistributedOptimizer", what)
            raise HorovodInternalError(
                f"{what}: mismatched tensors: rank {r} of the process set has {_describe_row(every[r])} but its "
                f"rank 0 has {_describe_row(every[0])} (they may differ in the first dimension only)")
    return every


def _allgather_start(tensor, name, process_set, what):
    _check_tensor(tensor, what)
    group = _group_of(process_set)
    n = _set_size(process_set)
    source = tensor.contiguous() if tensor.dim() else tensor.reshape(1)
    every = _exchange_shapes(source, group, n, what)
    firsts = every[:, 2].tolist()
    rest = list(source.shape[1:])
    output = source.new_empty([sum(firsts)] + rest)
    if len(set(firsts)) == 1:
        # Equal first dimensions: one allgather straight into the output.
        def launch():
            if group is _state.world_group:
                _note("x", "allgather")
            return _all_gather_into(_as_wire(output), _as_wire(source), group, async_op=True)
        finish = lambda: output  # noqa: E731
    else:
        # Uneven: every rank pads to the longest, the padded blocks are gathered, the padding cut off.
        longest = max(firsts)
        padded = source.new_zeros([longest] + rest)
        padded[:source.shape[0]] = source
        gathered = source.new_empty([n * longest] + rest)
        def launch():
            if group is _state.world_group:
                _note("x", "allgather")
            return _all_gather_into(_as_wire(gathered), _as_wire(padded), group, async_op=True)

        def finish():
            offset = 0
            for r, rows in enumerate(firsts):
                output[offset:offset + rows] = gathered[r * longest:r * longest + rows]
                offset += rows
            return output
    return _start(what, name, group, launch, finish)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts an allgather: the ranks' tensors concatenated along the first dimension (which may differ
    between ranks); returns a handle."""
    return _allgather_start(tensor, name, process_set, "allgather_async")


class _AllgatherGrad(torch.autograd.Function):
    """allgather as an autograd function: each rank's gradient is its rows of the summed gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.process_set = process_set
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.process_set
        rows = allgather(torch.tensor([ctx.rows]), process_set=ps).tolist()
        summed = _allreduce_now(grad, None, None, Sum, 1.0, 1.0, ps, "allgather (backward)")
        me = _set_rank(ps)
        start = sum(rows[:me])
        return summed[start:start + rows[me]], None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Returns the ranks' tensors concatenated along the first dimension. Differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherGrad.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts an allgather of each tensor of the list; synchronize() returns the list of results."""
    handles = [allgather_async(t, None, process_set) for t in tensors]
    return _start("grouped_allgather_async", name, None, lambda: None,
                  lambda: [synchronize(h) for h in handles])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """allgather of each tensor of the list; returns the list of results."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))
