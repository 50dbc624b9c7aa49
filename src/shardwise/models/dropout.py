"""Dropout whose masks do not depend on the layout.

A mask entry is a function of (train.seed, step, global sample index, the dropout module's
name, its position in the unsplit per-sample tensor) only: a generator seeded with those keys
draws each head's mask (attention probabilities, cut by heads: a rank draws only its heads) or
each sample's whole mask (hidden states: a rank keeps its sequence shard of it). So the
rank holding a sequence shard (sequence parallelism) or some attention heads (tensor
parallelism) drops exactly what the single-device run drops there: masks agree inside a
tensor-parallel group where the activation is replicated and differ where it is split, with
no RNG tracker to keep in step, and any layout (or a resumed run) reproduces the same masks.
The price is that with sequence parallelism each rank draws the whole s × h mask of a sample
(not the s² attention masks) to keep its shard.

The keys come from `random_stream` (the training loop: seed and step) and `samples` (each
micro-batch: its global sample indices), which the pipeline schedule also sets around every
forward and backward pass it runs, so recomputation in backward draws the same masks.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class _Keys:
    seed: int | None = None
    step: int | None = None
    samples: tuple[int, ...] | None = None


_KEYS = _Keys()


@contextlib.contextmanager
def _setting(**values) -> Iterator[None]:
    old = {k: getattr(_KEYS, k) for k in values}
    for k, v in values.items():
        setattr(_KEYS, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(_KEYS, k, v)


def random_stream(seed: int, step: int) -> contextlib.AbstractContextManager[None]:
    """Masks drawn inside are those of optimizer step `step` (0-based) of a run seeded `seed`."""
    return _setting(seed=seed, step=step)


def samples(indices: Sequence[int] | torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """Rows of the batch inside are the global samples `indices`, in order."""
    values = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
    return _setting(samples=tuple(int(i) for i in values))


def _seed(*keys: object) -> int:
    digest = hashlib.blake2b("/".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64


class _ApplyMask(torch.autograd.Function):
    """x · mask / (1 − p), saving the 1-byte mask (not a float copy) for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None, None


class LayoutFreeDropout(nn.Module):
    """Dropout on a tensor whose dim 0 is the batch. `split` names what a parallel layout
    may cut in the per-sample tensor: "heads" (attention probabilities [B, H, S, S], cut
    by tensor parallelism), "sequence" (hidden states [B, S, h], cut by sequence
    parallelism) or "features" (a row-parallel layer's input [B, S, h/t], cut along h:
    LoRA's dropout). `site` (the module's name in the model) and `shard` ((rank, count) of
    the cut this rank holds, None when whole) are set by the model and by parallel/."""

    def __init__(self, p: float, split: str) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} is not in [0, 1)")
        self.p, self.split = p, split
        self.site = ""
        self.shard: tuple[int, int] | None = None

    def extra_repr(self) -> str:
        return f"p={self.p}, split={self.split}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keys = _KEYS
        if keys.seed is None or keys.samples is None:
            raise RuntimeError(
                f"dropout at {self.site or 'a module'} needs the step and the global sample "
                "indices of the batch: run the model under shardwise.models.dropout."
                "random_stream(seed, step) and samples(indices), as the training loop does."
            )
        if len(keys.samples) != x.shape[0]:
            raise RuntimeError(
                f"dropout at {self.site}: {len(keys.samples)} sample indices for a batch of "
                f"{x.shape[0]}"
            )
        return _ApplyMask.apply(x, self._mask(x, keys), 1.0 / (1.0 - self.p))

    def _mask(self, x: torch.Tensor, keys: _Keys) -> torch.Tensor:
        rank, count = self.shard or (0, 1)
        part = x.shape[1]  # this rank's rows of the cut dimension
        gen = torch.Generator(device=x.device)
        draws = []
        for n in keys.samples:
            if self.split == "heads":  # one draw per head: a rank draws only the heads it holds
                for head in range(rank * part, (rank + 1) * part):
                    gen.manual_seed(_seed(keys.seed, keys.step, n, self.site, head))
                    draws.append(torch.rand(x.shape[2:], generator=gen, device=x.device))
            elif self.split == "features":  # one draw per sample, cut to this rank's columns
                gen.manual_seed(_seed(keys.seed, keys.step, n, self.site))
                width = x.shape[-1]
                whole = torch.rand((*x.shape[1:-1], width * count), generator=gen, device=x.device)
                draws.append(whole[..., rank * width : (rank + 1) * width])
            else:  # one draw per sample, cut to this rank's sequence shard
                gen.manual_seed(_seed(keys.seed, keys.step, n, self.site))
                whole = torch.rand((part * count, *x.shape[2:]), generator=gen, device=x.device)
                draws.append(whole[rank * part : (rank + 1) * part])
        return torch.stack(draws).reshape(x.shape) >= self.p


def name_sites(model: nn.Module) -> None:
    """Key every dropout module's masks by its name in `model` (the whole model: a pipeline
    stage keeps the names, so it keeps the masks)."""
    for name, module in model.named_modules():
        if isinstance(module, LayoutFreeDropout):
            module.site = name
