"""The output head and the cross-entropy, a chunk of tokens at a time (train.loss_chunks).

A language model's logits are [tokens, vocab]: at 4K tokens and a 128K vocabulary their fp32
log-softmax, saved for backward, outweighs every other activation of a small model. Here the
forward walks the tokens in chunks and, for each, computes the logits h_c Wᵀ, the summed loss
and at once its gradients: ∂L/∂h_c = (softmax - onehot) W and ∂L/∂W += (softmax - onehot)ᵀ h_c
(the cross-entropy gradient, e.g. Goodfellow et al. 2016 §6.2.2.3). Only those two are saved
([tokens, dim] and [vocab, dim]), never [tokens, vocab]; backward scales them by the incoming
gradient (the 1/global-count normalisation and the fp16 loss scale). This is the approach of
Liger-Kernel's fused linear cross-entropy and of Apple's "Cut Your Losses" (Wijmans et al.
2024), in plain PyTorch.

Semantics are those of `F.cross_entropy(logits.float(), targets, reduction="sum")` on the
head's output in compute dtype: logits in compute dtype, upcast to fp32 for the softmax,
targets equal to -100 add no loss and no gradient; the weight gradient is accumulated over
chunks in fp32 and stored in the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # torch's cross_entropy default (data/instruct.py masks with it)


def _chunks(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int, want: tuple
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(summed loss in fp32, ∂loss/∂h or None, ∂loss/∂weight or None) of h [N, D]."""
    want_h, want_w = want
    n = h.shape[0]
    # the chunks' sums add up in fp64: with many small chunks an fp32 running sum drifts
    # (1.4e-6 of the mean over 90 one-token chunks) where one fp32 reduction does not
    loss = torch.zeros((), dtype=torch.float64, device=h.device)
    grad_h = torch.empty_like(h) if want_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if want_w else None
    size = max(1, -(-n // max(chunks, 1)))
    for start in range(0, n, size):
        hc, tc = h[start : start + size], targets[start : start + size]
        logits = F.linear(hc, weight).float()  # as the head, then the loss's upcast
        kept = tc != IGNORE_INDEX
        safe = torch.where(kept, tc, 0)[:, None]
        lse = torch.logsumexp(logits, dim=-1)
        loss += ((lse - logits.gather(1, safe).squeeze(1)) * kept).sum()
        if not (want_h or want_w):
            continue
        g = logits.sub_(lse[:, None]).exp_()  # softmax, over the logits' own storage
        g.scatter_add_(1, safe, -kept[:, None].to(g.dtype))  # minus the one-hot target
        g = g.mul_(kept[:, None]).to(h.dtype)  # ignored tokens: no gradient
        if want_h:
            torch.mm(g, weight, out=grad_h[start : start + size])
        if want_w:
            grad_w.add_(g.t() @ hc)
    if grad_w is not None:
        grad_w = grad_w.to(weight.dtype)
    return loss.float(), grad_h, grad_w


class _ChunkedHeadLoss(torch.autograd.Function):
    """Loss sum of the head on h [N, D]; saves the gradients, not the logits."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunks):
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        loss, grad_h, grad_w = _chunks(h, weight, targets, chunks, want)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return (
            None if grad_h is None else grad_h * grad_loss,
            None if grad_w is None else grad_w * grad_loss,
            None,
            None,
        )


def chunked_loss_sum(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int
) -> torch.Tensor:
    """Summed cross-entropy of the logits h Wᵀ (h [..., D], targets [...]) computed `chunks`
    token chunks at a time, without materialising [tokens, vocab] for backward."""
    flat, flat_targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _ChunkedHeadLoss.apply(flat, weight, flat_targets, chunks)
    return _chunks(flat, weight, flat_targets, chunks, (False, False))[0]


class LMHead(nn.Linear):
    """The output head: a bias-free `nn.Linear` (same parameters, init and names) that, given
    the targets, returns the summed loss through `chunked_loss_sum` instead of the logits.
    Called as a module either way, so ZeRO-3's hooks gather its weight around the loss."""

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, chunks: int = 0
    ) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return chunked_loss_sum(x, self.weight, targets, chunks)
