"""Horovod's SyncBatchNorm: batch normalization whose statistics are those of the whole batch, across
every rank, in training, on CPU tensors as on GPU ones.

torch's own SyncBatchNorm (and Horovod's, which calls torch's CUDA kernels) only takes CUDA inputs;
this one is written with ordinary tensor operations, so it runs wherever torch does:

- forward: each rank computes its per-channel count, mean and sum of squared deviations (M2); one
  allgather brings every rank's, and each combines them (Chan's parallel formula: the global mean is
  the count-weighted mean, and M2 adds each rank's count x (its mean - the global mean)^2 to the
  ranks' M2s), which stays exact where sum-of-squares formulas cancel. The input is normalized with
  the global mean and (biased) variance; the running statistics take the unbiased variance, as
  BatchNorm's do.
- backward: the input's gradient needs two per-channel sums over the whole batch, sum(dy) and
  sum(dy * (x - mean)): one allreduce adds the ranks'. The weight's and bias's gradients stay the
  rank's own, as any parameter's: DistributedOptimizer (or DDP) reduces them with the others.

In eval mode with running statistics, nothing is exchanged (the running statistics are used).
"""
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .mpi_ops import Sum, allgather, allreduce, size


class SyncBatchNorm(_BatchNorm):
    """torch.nn.BatchNorm1d/2d/3d's arguments and behaviour, with statistics over all ranks.

    Input: (N, C) or (N, C, ...), any number of dimensions after C. Ranks may hold different batch
    sizes; every rank must call forward (and backward) together, as with any collective.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of at least 2 dimensions (N, C, ...), got {input.dim()}")

    def forward(self, input):
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise ValueError(f"SyncBatchNorm: expected {self.num_features} channels (dimension 1), got {input.size(1)}")
        # The factor by which the running statistics move, as _BatchNorm computes it.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        running_mean = self.running_mean if self.training else None
        running_var = self.running_var if self.training else None
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var,
                                            self.eps, factor)


def _per_channel(t):
    """(N, C, ...) -> (C, N * ...): one row per channel."""
    return t.transpose(0, 1).reshape(t.size(1), -1)


def _channel_shape(t):
    """The shape that broadcasts a per-channel vector against an (N, C, ...) tensor."""
    return [1, t.size(1)] + [1] * (t.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum):
        channels = input.size(1)
        rows = _per_channel(input.detach())
        count = rows.size(1)
        # Statistics in float64: the combination over ranks subtracts nearly equal numbers.
        if count > 0:
            rows = rows.double()
            mean = rows.mean(1)
            var = (rows - mean.unsqueeze(1)).square().mean(1)  # biased (var_mean's keyword differs in torch 2)
        else:
            var = mean = torch.zeros(channels, dtype=torch.float64, device=input.device)
        local = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=input.device), mean, var * count])
        every = allgather(local.unsqueeze(0), name="sync_batch_norm.stats")  # (ranks, 1 + 2C)
        counts, means, m2s = every[:, :1], every[:, 1:1 + channels], every[:, 1 + channels:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel across all ranks in "
                             f"training, got {int(total)}")
        global_mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - global_mean) ** 2).sum(0)
        global_var = m2 / total
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((m2 / (total - 1)).to(running_var.dtype), alpha=momentum)

        shape = _channel_shape(input)
        mean_t = global_mean.to(input.dtype).view(shape)
        invstd = torch.rsqrt(global_var + eps).to(input.dtype)
        normalized = (input - mean_t) * invstd.view(shape)
        output = normalized
        if weight is not None:
            output = output * weight.view(shape)
        if bias is not None:
            output = output + bias.view(shape)
        ctx.save_for_backward(input, weight, mean_t, invstd)
        ctx.total = float(total)
        ctx.has_bias = bias is not None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean_t, invstd = ctx.saved_tensors
        shape = _channel_shape(input)
        centered = input - mean_t
        dy = _per_channel(grad_output)
        sum_dy = dy.sum(1)
        sum_dy_xmu = (dy * _per_channel(centered)).sum(1)

        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1] and weight is not None:
            grad_weight = sum_dy_xmu * invstd
        if ctx.needs_input_grad[2] and ctx.has_bias:
            grad_bias = sum_dy.clone()
        if ctx.needs_input_grad[0]:
            # The whole batch's sums (one allreduce of both), then the gradient of normalization:
            # dx = w * invstd * (dy - sum(dy) / n - (x - mean) * invstd^2 * sum(dy * (x - mean)) / n).
            both = allreduce(torch.cat([sum_dy, sum_dy_xmu]), op=Sum, name="sync_batch_norm.grad_sums")
            channels = input.size(1)
            mean_dy = (both[:channels] / ctx.total).view(shape)
            mean_dy_xmu = (both[channels:] / ctx.total).view(shape)
            scale = invstd.view(shape)
            if weight is not None:
                scale = scale * weight.view(shape)
            grad_input = scale * (grad_output - mean_dy - centered * invstd.view(shape) ** 2 * mean_dy_xmu)
        return grad_input, grad_weight, grad_bias, None, None, None, None
