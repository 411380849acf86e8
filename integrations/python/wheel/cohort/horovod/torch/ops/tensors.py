"""What the collectives do to tensors around the backend's calls: the checks, the reduce op and the
pre/post scaling Horovod applies, the wire view of the dtypes cohort does not move as themselves, and
the dtype codes of the small exchanges that check the ranks' tensors agree."""
import torch
import torch.distributed as dist

from .state import _REDUCIBLE, _TORCH_OP, Adasum, Average, Sum


def _check_tensor(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported here (use sparse_allreduce_async)")


def _scale(tensor, factor):
    """tensor *= factor in place; integers are scaled in float64 and truncated, as Horovod does."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_((tensor.double() * factor).trunc())


def _divide(tensor, divisor):
    """Average's division: true division for floats, floor division for integers (Horovod's)."""
    if divisor == 1:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(divisor)
    else:
        tensor.floor_divide_(divisor)


def _reduce_op(op, average, what):
    """Horovod's (average, op) pair -> one of our op constants; Average when neither is given."""
    if op is not None and average is not None:
        raise ValueError(f"{what}: the op parameter supersedes average; pass one of them")
    if op is None:
        op = Average if average is None or average else Sum
    if op == Adasum:
        raise NotImplementedError(f"{what}: Adasum is not implemented by cohort; use op=hvd.Average or hvd.Sum")
    if op not in _TORCH_OP:
        raise ValueError(f"{what}: unknown reduce op {op!r}")
    return op


def _check_reducible(tensor, what):
    if tensor.dtype not in _REDUCIBLE:
        raise ValueError(f"{what}: dtype {tensor.dtype} cannot be reduced by cohort; supported: "
                         + ", ".join(str(d).replace("torch.", "") for d in sorted(_REDUCIBLE, key=str)))


def _wire_factor(dtype):
    """How many wire elements one element of `dtype` becomes in _as_wire."""
    if dtype in _REDUCIBLE:
        return 1
    if dtype.is_complex:
        return 2
    return torch.empty((), dtype=dtype).element_size()


def _as_wire(tensor):
    """The tensor cohort moves: itself for the dtypes it knows, else a byte view (bool, int16, complex)."""
    if tensor.dtype in _REDUCIBLE:
        return tensor
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor.reshape(-1).view(torch.uint8)


def _all_gather_into(output, tensor, group, async_op=False):
    fn = getattr(dist, "all_gather_into_tensor", None) or dist._all_gather_base
    return fn(output, tensor, group=group, async_op=async_op)


_DTYPE_CODE = {d: i for i, d in enumerate([
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
    torch.float64, torch.bool, torch.bfloat16, torch.complex64, torch.complex128])}
_CODE_DTYPE = {i: d for d, i in _DTYPE_CODE.items()}


def _describe_row(row):
    dtype = str(_CODE_DTYPE.get(int(row[0]), "unknown dtype")).replace("torch.", "")
    return f"{dtype}{row[2:2 + int(row[1])].tolist()}"
