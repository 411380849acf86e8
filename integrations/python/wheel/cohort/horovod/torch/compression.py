"""Gradient compression for DistributedOptimizer and allreduce: Horovod's `hvd.Compression`.

A compressor turns a tensor into the tensor that travels (`compress`, which also returns what
`decompress` needs to undo it) and back. `Compression.none` sends gradients as they are;
`Compression.fp16` sends floating-point gradients as float16, halving the bytes of float32 ones at
the price of float16's precision (about 3 significant digits) in the sum.
"""
import torch


class Compressor:
    """The interface: both methods are static, as in Horovod, so a class is passed, not an object."""

    @staticmethod
    def compress(tensor):
        """Returns (the tensor to send, the context `decompress` needs)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the received tensor in the form `compress` was given."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends the tensor unchanged (the default)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16; other dtypes (integers, bool) travel unchanged."""

    @staticmethod
    def compress(tensor):
        original_dtype = tensor.dtype
        if original_dtype.is_floating_point and original_dtype != torch.float16:
            tensor = tensor.to(torch.float16)
        return tensor, original_dtype

    @staticmethod
    def decompress(tensor, ctx):
        original_dtype = ctx
        if tensor.dtype != original_dtype:
            tensor = tensor.to(original_dtype)
        return tensor


class Compression:
    """The compressors, by Horovod's names: `Compression.none` and `Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
