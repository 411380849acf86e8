"""reducescatter: the reduction's first dimension split over the ranks (the first ones get one row more
when it does not divide evenly, as Horovod's); blocking or with a handle, grouped."""
import torch.distributed as dist

from .handles import _start, synchronize
from .join import _note
from .process_sets import _group_of, _set_rank, _set_size, global_process_set
from .state import _TORCH_OP, Average, _state
from .tensors import _check_reducible, _check_tensor, _divide, _reduce_op, _scale


def _scatter_rows(rows, n):
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


def _reducescatter_start(tensor, name, op, process_set, prescale_factor, postscale_factor, what):
    _check_tensor(tensor, what)
    _check_reducible(tensor, what)
    op = _reduce_op(op, None, what)
    if tensor.dim() == 0:
        raise ValueError(f"{what}: the tensor needs at least one dimension")
    group = _group_of(process_set)
    n = _set_size(process_set)
    me = _set_rank(process_set)
    counts = _scatter_rows(tensor.shape[0], n)
    source = tensor.contiguous().clone()
    _scale(source, prescale_factor)
    reduce_scatter = getattr(dist, "reduce_scatter_tensor", None) or dist._reduce_scatter_base
    longest = counts[0]
    if len(set(counts)) == 1:
        output = tensor.new_empty([longest] + list(tensor.shape[1:]))
        def launch():
            if group is _state.world_group:
                _note("x", "reducescatter")
            return reduce_scatter(output, source, _TORCH_OP[op], group=group, async_op=True)
        result = lambda: output  # noqa: E731
    else:
        # Uneven rows: each rank's block is padded to the longest (rank 0's), reduced and scattered
        # as even blocks; every rank keeps its real rows (the padding rows only meet padding).
        padded = source.new_zeros([n * longest] + list(tensor.shape[1:]))
        offset = 0
        for r, rows in enumerate(counts):
            padded[r * longest:r * longest + rows] = source[offset:offset + rows]
            offset += rows
        block = tensor.new_empty([longest] + list(tensor.shape[1:]))
        def launch():
            if group is _state.world_group:
                _note("x", "reducescatter")
            return reduce_scatter(block, padded, _TORCH_OP[op], group=group, async_op=True)
        result = lambda: block[:counts[me]]  # noqa: E731

    def finish():
        out = result()
        _scale(out, postscale_factor)
        if op == Average:
            _divide(out, n)
        return out

    return _start(what, name, group, launch, finish)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Starts a reducescatter: the reduction (Average by default) of every rank's `tensor`, of which each
    rank gets its block of rows; returns a handle."""
    return _reducescatter_start(tensor, name, op, process_set, prescale_factor, postscale_factor,
                                "reducescatter_async")


def reducescatter(tensor, name=None, compression=None, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Blocking reducescatter; see reducescatter_async."""
    ctx = None
    if compression is not None:
        tensor, ctx = compression.compress(tensor)
    out = synchronize(_reducescatter_start(tensor, name, op, process_set, prescale_factor, postscale_factor,
                                           "reducescatter"))
    return compression.decompress(out, ctx) if compression is not None else out


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reducescatter of each tensor of the list; synchronize() returns the list of results."""
    handles = [_reducescatter_start(t, None, op, process_set, prescale_factor, postscale_factor,
                                    "grouped_reducescatter_async") for t in tensors]
    return _start("grouped_reducescatter_async", name, None, lambda: None, lambda: [synchronize(h) for h in handles])


def grouped_reducescatter(tensors, name=None, compression=None, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    """Blocking grouped reducescatter."""
    ctxs = None
    if compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        tensors, ctxs = [p[0] for p in pairs], [p[1] for p in pairs]
    outs = synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor, postscale_factor))
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)] if compression is not None else outs
