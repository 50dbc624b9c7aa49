"""AdamW over fp32 master weights, dynamic loss scaling, and the learning-rate schedule.

With `precision.compute` fp32 the model parameters are their own masters; with bf16/fp16 the
model holds low-precision compute copies and this module keeps fp32 masters beside them
(Micikevicius et al. 2018, "Mixed Precision Training"): gradients are up-cast, unscaled,
clipped and applied in fp32, then the updated masters are copied back into the compute copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.config import Config
from shardwise.optim.update import (  # noqa: F401 (what callers import from shardwise.optim)
    EIGHT_BIT,
    QUANT_BLOCK,
    TorchUpdate,
    adamw,
    quiet_bitsandbytes,
)


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16: halve on overflow (and skip the step), double after
    `window` finite steps. Inactive (scale 1) for fp32 and bf16, whose range needs none."""

    enabled: bool
    scale: float = 1.0
    window: int = 1000
    good_steps: int = 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale = max(self.scale / 2.0, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2.0
            self.good_steps = 0


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    nonfinite: tuple[str, ...] = ()  # targets (this rank's pieces) whose gradient is not finite
    loss: float = math.nan  # the step's reduced loss handed to `step` (fetched with the norm)


@dataclass
class Target:
    """One tensor the optimizer updates: the compute copy (or its local shard) the update must
    land in, where its reduced gradient lives, and whether weight decay applies."""

    param: torch.Tensor
    grad: Callable[[], torch.Tensor]
    decay: bool
    # over tensor parallelism: "shard" (disjoint slices), "replica" (the same on every tp
    # rank) or "partial" (partial gradients summed over tp before use); see parallel/tensor.py
    tp: str = "replica"
    name: str = ""  # the parameter's model name (checkpoints key optimizer state by it)
    span: tuple[int, int] | None = None  # elements of the flattened parameter (None: all)
    in_norm: bool = True  # False for a second copy of a weight counted elsewhere (tied, pp)


def replicated_targets(model: nn.Module) -> list[Target]:
    """Data parallelism: every parameter, its gradient in the bucket view `main_grad`.
    No weight decay on gains and biases (1-D), as in GPT-2/LLaMA training recipes."""
    return [
        Target(p, (lambda p=p: p.main_grad), p.ndim >= 2, getattr(p, "tp_kind", "replica"), name)
        for name, p in model.named_parameters()
        if p.requires_grad
    ]


class MixedPrecisionAdamW:
    """One level of composition: fp32 masters + AdamW + clipping + loss scale.

    `sum_over_shards` adds up partial squared norms when each rank holds only a shard of the
    gradients; it receives [squared norm of tp-sharded targets, of the others] (ZeRO sums
    both over dp, tensor parallelism the first over tp). `reduce_partial` sums the gradients
    of `partial` targets over tp. `after_step` publishes updated compute copies (e.g.
    all-gathers them). Where the masters and moments live and what steps them is
    `self.update` (optim/update.py)."""

    def __init__(
        self,
        targets: list[Target],
        cfg: Config,
        sum_over_shards: Callable[[torch.Tensor], None] | None = None,
        after_step: Callable[[], None] | None = None,
        offload: bool = False,
        reduce_partial: Callable[[list[torch.Tensor]], None] | None = None,
        nvme: tuple[str, int] | None = None,
    ) -> None:
        self.targets = targets
        params = [t.param for t in targets]
        self.device = params[0].device if params else torch.device("cpu")
        # Offload (ZeRO-Offload, Ren et al. 2021): fp32 masters and Adam state live in host
        # memory and the update runs on the CPU; only gradients go down, parameters come up.
        # `nvme` (folder, rank): they live on local disk instead, streamed through two host
        # slots (optim/nvme.py; ZeRO-Infinity).
        self.offload = offload or nvme is not None  # the masters and moments off the device
        if nvme is not None:
            from shardwise.optim.nvme import NvmeUpdate

            self.update = NvmeUpdate(targets, cfg, *nvme)
        else:
            self.update = TorchUpdate(targets, cfg, offload)
        self.grad_clip = cfg.optim.grad_clip
        self._kinds: tuple[torch.Tensor, ...] | None = None  # (_target_kinds)
        self.sum_over_shards = sum_over_shards
        self.reduce_partial = reduce_partial
        self.after_step = after_step
        p = cfg.precision
        self.scaler = LossScaler(
            p.compute == "fp16", p.loss_scale if p.compute == "fp16" else 1.0, p.scale_window
        )

    @property
    def inner(self) -> torch.optim.Optimizer | None:
        """The torch (or bitsandbytes) optimizer stepping the masters; None on disk."""
        return self.update.inner

    @property
    def masters(self) -> list[torch.Tensor]:
        """The fp32 values stepped, one per target (the parameters themselves in fp32)."""
        return self.update.masters

    @property
    def separate_master(self) -> bool:
        """Whether the masters are copies beside the parameters."""
        return self.update.separate_master

    @property
    def master_bytes(self) -> int:
        return self.update.master_bytes

    @property
    def state_bytes(self) -> int:
        return self.update.state_bytes

    @property
    def disk_bytes(self) -> int:
        return self.update.disk_bytes

    def adam_steps(self) -> int:
        """AdamW's step count (the same for every tensor: a skipped step skips them all)."""
        return self.update.adam_steps()

    def close(self) -> None:
        """Release what lives outside the process (the NVMe state's folder)."""
        self.update.close()

    # -- checkpoints: the moments as fp32 tensors, whatever the optimizer keeps -------------------
    def moments(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's two moments of `master` at fp32 (checkpoints store these for any optimizer,
        so they are layout-free and an 8-bit run resumes in any layout): torch's own state
        tensors, views of the state on disk, or bitsandbytes' 8-bit blocks dequantised
        (copies; `store_moments` writes edited copies back)."""
        return self.update.moments(master)

    def quantised(self, master: torch.Tensor) -> bool:
        """Whether `master`'s moments are kept in 8 bits (loading them needs `store_moments`)."""
        return self.update.quantised(master)

    def store_moments(self, master: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Quantise fp32 moments back into an 8-bit state (otherwise `moments` gave the state
        itself, nothing to do); exactly the state they were dequantised from when the blocks
        are cut alike (`requantise`)."""
        self.update.store_moments(master, values)

    def fresh_state(self, step: int) -> None:
        """Give every master zero moments and the step count `step` (before a checkpoint's
        moments are loaded into them)."""
        self.update.fresh_state(step)

    def set_lr(self, lr: float) -> None:
        self.update.set_lr(lr)

    @torch.no_grad()
    def step(self, loss: torch.Tensor | None = None, skip: bool = False) -> StepResult:
        """Unscale, measure the global norm, clip and step; returns the norm and whether the
        step was skipped: a non-finite norm skips it on every rank alike, and so does a
        non-finite `loss` (the step's loss, already reduced: every rank sees the same value)
        or `skip`. The norm and the loss come to the host in one transfer, the step's only
        one: skip and clip need them."""
        grads = self.update.take_grads(self.targets)
        if self.reduce_partial is not None:
            self.reduce_partial(
                [g for g, t in zip(grads, self.targets, strict=True) if t.tp == "partial"]
            )
        if grads and self.scaler.scale != 1.0:  # (a frozen pipeline stage has none)
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        norms, parts = self._squared_norms(grads)
        parts = parts.to(self.device)  # collectives run on the compute device
        if self.sum_over_shards is not None:
            self.sum_over_shards(parts)
        if loss is not None:
            parts = torch.cat([parts, loss.detach().double().reshape(1).to(parts.device)])
        fetched = parts.tolist()  # [tp-sharded, the rest(, loss)]: one transfer
        norm_value = math.sqrt(fetched[0] + fetched[1])  # = float(parts[:2].sum()), bitwise
        loss_value = fetched[2] if loss is not None else math.nan
        skip = skip or (loss is not None and not math.isfinite(loss_value))
        finite = math.isfinite(norm_value)
        self.scaler.update(finite)
        if finite and not skip:
            if grads and self.grad_clip > 0 and norm_value > self.grad_clip:
                torch._foreach_mul_(grads, self.grad_clip / (norm_value + 1e-6))
            self.update.apply(grads)
            if self.after_step is not None:
                self.after_step()
        self.update.release_grads()
        bad = ()
        if not finite:  # name the culprits (one more sync, on skipped steps only)
            flags = (~torch.isfinite(norms)).tolist()
            bad = tuple(t.name for t, f in zip(self.targets, flags, strict=True) if f)
        return StepResult(norm_value, not finite or skip, bad, loss_value)

    def _squared_norms(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(squared norm per target, [squared norm of tp-sharded targets, of the others]):
        over tp the first adds up, the second is counted once. No host sync: the targets'
        kinds are index tensors made once on the norms' device (a boolean mask would sync to
        size its result, and a list copied in each step would wait for the device)."""
        if not grads:
            return torch.zeros(0, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        norms = torch.stack([squared_norm(g) for g in grads])
        if self._kinds is None or self._kinds[0].device != norms.device:
            self._kinds = _target_kinds(self.targets, norms.device)
        counted, sharded, rest = self._kinds
        norms = norms * counted
        # index_select takes the masked elements in the same order: the sums are bitwise those
        # of norms[mask].sum()
        parts = torch.stack(
            [norms.index_select(0, sharded).sum(), norms.index_select(0, rest).sum()]
        )
        return norms, parts


# elements per fp32 partial sum of `squared_norm`
NORM_BLOCK = 1024


def squared_norm(g: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of `g` as an fp64 scalar: fp32 norms of blocks of NORM_BLOCK
    elements, their squares summed in fp64."""
    # One fp32 sum over a large tensor is off by ~1e-6 relative, and by a different amount when
    # the tensor is cut into other shards (layout invariance). fp64 throughout is exact enough
    # but a CPU converts each element: 693 ms for 134M elements, against 68 ms in fp32 blocks
    # and ~100 ms for torch's fused AdamW step itself (benchmarks/optimizer_step.py). A block's
    # fp32 sum errs by < 1e-6 relative (log2(1024) roundings), so the total does too, whatever
    # the shards (measured: 1e-9 against fp64); AdamW's update is invariant to the scale of its
    # gradient (but for eps), so a clip coefficient off by that much moves it by far less.
    flat = g.reshape(-1)
    whole = flat.numel() - flat.numel() % NORM_BLOCK
    parts = [torch.zeros(0, dtype=flat.dtype, device=flat.device)]  # (an empty shard: 0)
    if whole:
        parts.append(torch.linalg.vector_norm(flat[:whole].view(-1, NORM_BLOCK), dim=1))
    if whole < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
    return torch.cat(parts).double().square().sum()


def _target_kinds(targets: list[Target], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(whether each target counts in the norm, indices of tp-sharded targets, of the others)
    on `device`."""
    sharded = [t.tp == "shard" for t in targets]
    return (
        torch.tensor([t.in_norm for t in targets], device=device),
        torch.tensor([i for i, s in enumerate(sharded) if s], dtype=torch.long, device=device),
        torch.tensor([i for i, s in enumerate(sharded) if not s], dtype=torch.long, device=device),
    )


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to train.lr, then cosine (or constant) down to lr·min_lr_ratio.

    `step` counts from 0; step 0 already uses a non-zero lr (1/warmup of the peak)."""
    peak, o, total = cfg.train.lr, cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return peak * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return peak
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    floor = peak * o.min_lr_ratio
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * min(progress, 1.0)))
