"""allreduce and its family: in place or not, blocking or with a handle, differentiable, grouped (one
allreduce per dtype over the tensors flattened into one buffer) and sparse."""
import torch
import torch.distributed as dist

from .handles import _AllWork, _claim_name, _start, _translate_errors, synchronize
from .join import _note
from .process_sets import _group_of, _set_size, global_process_set
from .state import _TORCH_OP, Average, Sum, _state
from .tensors import _check_reducible, _check_tensor, _divide, _reduce_op, _scale


def _torch_op(op, tensor, n):
    """The backend's op for Horovod's `op` on `tensor`, and what to divide the result by afterwards.
    Average on floating dtypes is the backend's AVG, which divides as it reduces (one pass over the
    tensor less than a sum and a division); on integers it is a sum, then Horovod's floor division."""
    if op == Average:
        if tensor.is_floating_point():
            return dist.ReduceOp.AVG, 1
        return dist.ReduceOp.SUM, n
    return _TORCH_OP[op], 1


def _allreduce_start(tensor, output, name, op, prescale_factor, postscale_factor, process_set, what):
    _check_tensor(tensor, what)
    _check_reducible(tensor, what)
    group = _group_of(process_set)
    torch_op, divisor = _torch_op(op, tensor, _set_size(process_set))
    if output is None:
        output = tensor.clone(memory_format=torch.contiguous_format)
    _scale(output, prescale_factor)

    def finish():
        _scale(output, postscale_factor)
        _divide(output, divisor)
        return output

    def launch():
        if group is _state.world_group:
            _note("ar", output.numel(), output.dtype, torch_op)
        return dist.all_reduce(output, torch_op, group=group, async_op=True)

    return _start(what, name, group, launch, finish)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Starts an allreduce of `tensor` into a new tensor; returns a handle for poll()/synchronize()."""
    op = _reduce_op(op, average, "allreduce_async")
    return _allreduce_start(tensor, None, name, op, prescale_factor, postscale_factor, process_set,
                            "allreduce_async")


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Starts an in-place allreduce of `tensor`; returns a handle for poll()/synchronize()."""
    op = _reduce_op(op, average, "allreduce_async_")
    return _allreduce_start(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set,
                            "allreduce_async_")


def _allreduce_now(tensor, output, name, op, prescale_factor, postscale_factor, process_set, what):
    """The blocking path, without a handle: the per-call cost matters for many small gradients.
    output None: the result goes to a new contiguous tensor."""
    _check_tensor(tensor, what)
    _check_reducible(tensor, what)
    group = _group_of(process_set)
    if name is not None and name in _state.names_in_flight:
        _claim_name(name, what)  # raises the duplicate-name error
    torch_op, divisor = _torch_op(op, tensor, _set_size(process_set))
    if output is None:
        output = tensor.clone(memory_format=torch.contiguous_format)
    _scale(output, prescale_factor)
    if group is _state.world_group:
        _note("ar", output.numel(), output.dtype, torch_op)
    _translate_errors(what, group, dist.all_reduce, output, torch_op, group)
    _scale(output, postscale_factor)
    _divide(output, divisor)
    return output


class _AllreduceGrad(torch.autograd.Function):
    """allreduce as an autograd function: the gradient is allreduced with the same op and factors."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return _allreduce_now(tensor, None, name, op, prescale_factor, postscale_factor, process_set, "allreduce")

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        return _allreduce_now(grad, None, None, op, pre, post, ps, "allreduce (backward)"), None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Returns the reduction of `tensor` over the ranks (Average by default); `tensor` is unchanged.
    Differentiable. `compression` (hvd.Compression.none/fp16) compresses what travels."""
    op = _reduce_op(op, average, "allreduce")
    ctx = None
    if compression is not None:
        tensor, ctx = compression.compress(tensor)
    if tensor.requires_grad and torch.is_grad_enabled():
        result = _AllreduceGrad.apply(tensor, name, op, prescale_factor, postscale_factor, process_set)
    else:
        result = _allreduce_now(tensor, None, name, op, prescale_factor, postscale_factor, process_set, "allreduce")
    return compression.decompress(result, ctx) if compression is not None else result


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduces `tensor` in place over the ranks (Average by default) and returns it."""
    op = _reduce_op(op, average, "allreduce_")
    return _allreduce_now(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set, "allreduce_")


# ---------------------------------------------------------------------------------------------
# grouped allreduce: one allreduce per dtype over the tensors flattened into one buffer
# ---------------------------------------------------------------------------------------------
def _grouped_allreduce_start(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set, what):
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"{what}: expected a non-empty list of tensors")
    for t in tensors:
        _check_tensor(t, what)
        _check_reducible(t, what)
    group = _group_of(process_set)
    n = _set_size(process_set)
    # One flat buffer per dtype, in first-seen order (the same order on every rank, which the
    # communicator's signatures check through the buffers' counts and dtypes).
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    buffers = []
    for dtype, indices in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        _scale(flat, prescale_factor)
        buffers.append((flat, indices) + _torch_op(op, flat, n))

    def launch():
        if group is _state.world_group:
            for flat, _, torch_op, _ in buffers:
                _note("ar", flat.numel(), flat.dtype, torch_op)
        works = [dist.all_reduce(flat, torch_op, group=group, async_op=True) for flat, _, torch_op, _ in buffers]
        return _AllWork(works)

    def finish():
        for flat, indices, _, divisor in buffers:
            _scale(flat, postscale_factor)
            _divide(flat, divisor)
            offset = 0
            for i in indices:
                n = tensors[i].numel()
                outputs[i].copy_(flat[offset:offset + n].view(tensors[i].shape))
                offset += n
        return list(outputs)

    return _start(what, name, group, launch, finish)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Starts the allreduce of a list of tensors as one operation per dtype; returns a handle whose
    synchronize() gives the list of results."""
    op = _reduce_op(op, average, "grouped_allreduce_async")
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _grouped_allreduce_start(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set,
                                    "grouped_allreduce_async")


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Starts the in-place allreduce of a list of tensors; returns a handle."""
    op = _reduce_op(op, average, "grouped_allreduce_async_")
    return _grouped_allreduce_start(tensors, list(tensors), name, op, prescale_factor, postscale_factor,
                                    process_set, "grouped_allreduce_async_")


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """The reductions of a list of tensors (Average by default); the inputs are unchanged."""
    op = _reduce_op(op, average, "grouped_allreduce")
    ctxs = None
    if compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        tensors, ctxs = [p[0] for p in pairs], [p[1] for p in pairs]
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    results = synchronize(_grouped_allreduce_start(tensors, outputs, name, op, prescale_factor, postscale_factor,
                                                   process_set, "grouped_allreduce"))
    if compression is not None:
        results = [compression.decompress(r, c) for r, c in zip(results, ctxs)]
    return results


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduces a list of tensors in place and returns it."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Starts the allreduce of a sparse COO tensor (Sum or Average): every rank's entries gathered and
    coalesced; returns a handle whose synchronize() gives the sparse result."""
    if op not in (Sum, Average):
        raise ValueError("sparse_allreduce_async: only Sum and Average are supported for sparse tensors")
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async: expected a sparse COO tensor")
    group = _group_of(process_set)
    output = tensor.clone()
    n = _set_size(process_set)

    def finish():
        return output / n if op == Average else output

    def launch():
        if group is _state.world_group:
            _note("x", "sparse allreduce")
        return dist.all_reduce(output, dist.ReduceOp.SUM, group=group, async_op=True)

    return _start("sparse_allreduce_async", name, group, launch, finish)
