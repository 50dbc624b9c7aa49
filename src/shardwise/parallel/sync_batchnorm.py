"""Synchronised BatchNorm over data parallelism (`model.sync_batchnorm`).

A BatchNorm normalises with its batch's statistics, so under plain data parallelism each
replica normalises with its own micro-batch's and the run depends on the layout. Here every
BatchNorm forward sums its per-channel statistics over the dp ranks first (one all-reduce of
2C+1 float64 numbers), normalises with the statistics of all replicas' micro-batches
together and updates its running statistics from them (unbiased variance, as torch does): a
run on N ranks with micro-batch b equals one process with micro-batch N·b (what
torch.nn.SyncBatchNorm does on GPUs, over the comm layer and on any device). The all-reduce
is differentiable: its backward sums the statistics' gradients over the ranks, which is what
the global batch's normalisation gives every sample. The module forward is patched in place:
names, parameters and buffers stay. Evaluation uses the running statistics, unchanged.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.autograd import Function

from shardwise.distributed.comm import Comm
from shardwise.parallel.recompute import recomputing


class _SumOverDp(Function):
    """All-reduce (sum) over dp forward; the gradient, summed over dp, backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        out = x.clone()
        comm.all_reduce(out, "dp")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.comm.all_reduce(grad, "dp")
        return grad, None


def _forward(self: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """BatchNorm's training forward with the statistics of every dp replica's batch."""
    if not self.training:
        return self._plain_forward(x)
    dims = [0, *range(2, x.dim())]
    xf = x.float()  # statistics in fp32 whatever the compute precision
    count = x.numel() // x.shape[1]
    # this replica's mean and centred sum of squares (two passes: no cancellation), combined
    # over the replicas in float64 (Chan et al. 1979): sum n_r·mean_r and sum (M2_r +
    # n_r·mean_r²), whose difference from N·mean² then loses nothing that matters
    mean_r = xf.mean(dims)
    m2_r = (xf - mean_r.view((1, -1) + (1,) * (x.dim() - 2))).square().sum(dims)
    n_r = torch.full((1,), float(count), dtype=torch.float64, device=x.device)
    local = torch.cat([n_r, count * mean_r.double(), m2_r.double() + count * mean_r.double() ** 2])
    stats = _SumOverDp.apply(local, self._comm)
    c = x.shape[1]
    n, mean = stats[0], stats[1 : c + 1] / stats[0]
    var = (stats[c + 1 :] / n - mean * mean).clamp_min(0)  # biased, as a batch normalises
    mean, var = mean.float(), var.float()
    if self.track_running_stats and not recomputing():  # a replay counts its forward once
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            m = (
                self.momentum
                if self.momentum is not None
                else 1.0 / float(self.num_batches_tracked)
            )
            self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            unbiased = var.detach() * float(n / (n - 1))
            self.running_var.mul_(1 - m).add_(unbiased, alpha=m)
    shape = (1, c) + (1,) * (x.dim() - 2)
    y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
    if self.affine:
        y = y * self.weight.view(shape) + self.bias.view(shape)
    return y.to(x.dtype)


def apply_sync_batchnorm(model: nn.Module, comm: Comm) -> int:
    """Synchronise every BatchNorm of `model` over dp; returns how many. At dp = 1 the
    all-reduce is a no-op but the arithmetic is the same, so one process reproduces N."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module._comm = comm
            module._plain_forward = module.forward
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
