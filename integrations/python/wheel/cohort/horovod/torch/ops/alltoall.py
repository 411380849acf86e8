"""alltoall: rows of each rank's tensor go to the ranks (by splits, or evenly), after one small
alltoall that tells every rank how many rows it receives and checks the ranks' tensors agree."""
import math

import torch
import torch.distributed as dist

from .handles import _start, _translate_errors, synchronize
from .join import _note, _refuse_if_joined
from .process_sets import _group_of, _set_rank, _set_size, global_process_set
from .state import HorovodInternalError, _state
from .tensors import _CODE_DTYPE, _DTYPE_CODE, _as_wire, _check_tensor, _wire_factor


def _alltoall_start(tensor, splits, name, process_set, what):
    _check_tensor(tensor, what)
    group = _group_of(process_set)
    n = _set_size(process_set)
    source = tensor.contiguous()
    if source.dim() == 0:
        raise ValueError(f"{what}: the tensor needs at least one dimension")
    rows = source.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"{what}: splits not given, but the first dimension ({rows}) is not a multiple "
                             f"of the number of ranks ({n})")
        send = [rows // n] * n
    else:
        send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(send) != n:
            raise ValueError(f"{what}: splits has {len(send)} entries; the process set has {n} ranks")
        if any(s < 0 for s in send) or sum(send) > rows:
            raise ValueError(f"{what}: splits {send} must be >= 0 and sum to at most the first dimension ({rows})")
        source = source[:sum(send)]
    # One small alltoall first: rank j learns how many rows each rank sends it, and every rank
    # checks that the others' tensors agree in dtype and in every dimension but the first.
    slots = 10
    if source.dim() > slots - 2:
        raise ValueError(f"{what}: tensors of more than {slots - 2} dimensions are not supported")
    info = torch.full((n, slots), -1, dtype=torch.int64)
    info[:, 0] = torch.tensor(send, dtype=torch.int64)
    info[:, 1] = _DTYPE_CODE.get(source.dtype, 99)
    info[:, 2:2 + source.dim() - 1] = torch.tensor(source.shape[1:], dtype=torch.int64) if source.dim() > 1 else -1
    info[:, 9] = source.dim()
    got = torch.empty_like(info)
    if group is _state.world_group:
        _note("a2a", slots)
    _translate_errors(what, group, dist.all_to_all_single, got, info, None, None, group)
    mine = info[0, 1:]
    for r in range(n):
        if not torch.equal(got[r, 1:], mine):
            _refuse_if_joined(got, "Alltoall is not supported with Join at this time.", what)
            raise HorovodInternalError(
                f"{what}: mismatched tensors: rank {r} of the process set sends {_describe_alltoall(got[r])} "
                f"but rank {_set_rank(process_set)} has {_describe_alltoall(info[0])} (they may differ in the "
                "first dimension only)")
    received = got[:, 0].tolist()
    output = source.new_empty([sum(received)] + list(source.shape[1:]))
    # Split sizes count elements of the flat wire tensors: a row is row_numel elements of the dtype,
    # and more of them where the dtype travels as its float pairs or bytes (_as_wire).
    per_row = math.prod(source.shape[1:]) * _wire_factor(source.dtype)
    wire_in, wire_out = _as_wire(source).reshape(-1), _as_wire(output).reshape(-1)

    def launch():
        if group is _state.world_group:
            _note("x", "alltoall")
        return dist.all_to_all_single(wire_out, wire_in, [r * per_row for r in received],
                                      [s * per_row for s in send], group=group, async_op=True)

    received_splits = (splits.new_tensor(received) if isinstance(splits, torch.Tensor)
                       else torch.tensor(received, dtype=torch.int32))

    def finish():
        return output if splits is None else (output, received_splits)

    return _start(what, name, group, launch, finish)


def _describe_alltoall(row):
    dims = int(row[9])
    dtype = str(_CODE_DTYPE.get(int(row[1]), "unknown dtype")).replace("torch.", "")
    return f"{dtype}[*, {', '.join(str(d) for d in row[2:2 + dims - 1].tolist())}]" if dims > 1 else f"{dtype}[*]"


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts an alltoall: rows of `tensor` go to the ranks (splits[j] rows to rank j, or an even split),
    each rank receives its rows from every rank in rank order. synchronize() returns the output, or
    (output, received_splits) when splits were given."""
    return _alltoall_start(tensor, splits, name, process_set, "alltoall_async")


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Blocking alltoall; see alltoall_async."""
    return synchronize(_alltoall_start(tensor, splits, name, process_set, "alltoall"))
