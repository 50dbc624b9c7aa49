"""The conjugate communication operators of tensor and sequence parallelism, as autograd
Functions over the `tp` dimension of a Comm.

Megatron-LM (Shoeybi et al. 2019, §3, fig. 3) brackets every parallel region with f and g:

* f (`enter_tp`): identity forward, all-reduce backward — the input of column-parallel layers;
* g (`exit_tp`): all-reduce forward, identity backward — the output of row-parallel layers.

Sequence parallelism (Korthikanti et al. 2022, §4.2.2, fig. 6) replaces them by
g = all-gather along the sequence (backward: reduce-scatter) and ḡ = reduce-scatter along the
sequence (backward: all-gather): the same bytes, but everything outside the regions (norms,
residual stream) is sharded along the sequence. Per layer (two regions) each rank sends
8·b·s·h·(t−1)/t elements in forward+backward either way (ring accounting of `Comm`).

`vocab_cross_entropy` is the vocabulary-parallel loss (Megatron's `vocab_parallel_cross_entropy`):
each rank holds logits for a slice of the vocabulary; three b·s-sized all-reduces give the
global max, sum of exponentials and target logit, so the full logits never exist on one rank.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from shardwise.distributed.comm import Comm

SEQ_DIM = 1  # activations are [batch, sequence, hidden]


class _Enter(Function):
    """f: identity forward, all-reduce of the input gradient over tp backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # a copy: autograd may hand the same gradient tensor to other consumers
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.comm.all_reduce(grad, "tp")
        return grad, None


class _Exit(Function):
    """g: all-reduce forward (the partial sums of a row-parallel matmul), identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        # in place on the matmul output (nothing else holds it), as Megatron-LM does
        if x.is_contiguous():
            ctx.mark_dirty(x)
        else:
            x = x.contiguous()
        comm.all_reduce(x, "tp")
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _gather_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[b, s/t, ...] on each rank -> [b, s, ...], rank r's chunk at position r."""
    part = x.movedim(SEQ_DIM, 0).contiguous()
    n = comm.topo.size("tp")
    full = part.new_empty((n * part.shape[0], *part.shape[1:]))
    comm.all_gather(full, part, "tp")
    return full.movedim(0, SEQ_DIM).contiguous()


def _scatter_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[b, s, ...] partial sums -> this rank's summed chunk [b, s/t, ...]."""
    full = x.movedim(SEQ_DIM, 0).contiguous()
    n = comm.topo.size("tp")
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    comm.reduce_scatter(out, full, "tp")
    return out.movedim(0, SEQ_DIM).contiguous()


class _EnterSeq(Function):
    """SP g: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter_seq(grad, ctx.comm), None


class _ExitSeq(Function):
    """SP ḡ: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _scatter_seq(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_seq(grad, ctx.comm), None


def enter_tp(x: torch.Tensor, comm: Comm, sp: bool) -> torch.Tensor:
    """Into a tensor-parallel region (the input of column-parallel layers)."""
    if comm.topo.size("tp") == 1:
        return x
    return _EnterSeq.apply(x, comm) if sp else _Enter.apply(x, comm)


def exit_tp(x: torch.Tensor, comm: Comm, sp: bool) -> torch.Tensor:
    """Out of a tensor-parallel region (the partial sums of row-parallel layers)."""
    if comm.topo.size("tp") == 1:
        return x
    return _ExitSeq.apply(x, comm) if sp else _Exit.apply(x, comm)


IGNORE_INDEX = -100  # a target that carries no loss (a prompt or padding token)


class _VocabCrossEntropy(Function):
    """Per-token cross-entropy from vocabulary-sharded logits [N, V/t] (fp32)."""

    @staticmethod
    def forward(ctx, logits, targets, lo: int, valid: int, comm: Comm):
        n_local = logits.shape[-1]
        if valid < n_local:  # padded vocabulary columns take no part in the softmax
            logits = logits.clone()
            logits[:, valid:] = float("-inf")
        peak = logits.max(dim=-1).values
        comm.all_reduce(peak, "tp", op="max")
        exp = (logits - peak[:, None]).exp_()
        local_t = targets - lo
        mine = (local_t >= 0) & (local_t < valid)
        local_t = local_t.clamp(0, n_local - 1)
        rows = torch.arange(logits.shape[0], device=logits.device)
        target_logit = torch.where(mine, logits[rows, local_t] - peak, 0.0)
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # one all-reduce for both
        comm.all_reduce(sums, "tp")
        sum_exp, target_logit = sums[0], sums[1]
        exp.div_(sum_exp[:, None])  # the local slice of the softmax, kept for backward
        kept = targets != IGNORE_INDEX  # as F.cross_entropy: no loss, no gradient
        ctx.save_for_backward(exp, local_t, mine, kept)
        return (sum_exp.log() - target_logit) * kept

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, mine, kept = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        grad_logits = softmax.clone()
        grad_logits[rows, local_t] -= mine.to(softmax.dtype)
        return grad_logits * (grad * kept)[:, None], None, None, None, None


def vocab_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, lo: int, valid: int, comm: Comm
) -> torch.Tensor:
    """Summed cross-entropy of `targets` [...] given this rank's logits [..., V/t] for the
    vocabulary ids [lo, lo + valid) (columns past `valid` are padding)."""
    flat = logits.float().flatten(0, -2)
    return _VocabCrossEntropy.apply(flat, targets.flatten(), lo, valid, comm).sum()
