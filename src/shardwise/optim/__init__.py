"""AdamW over fp32 master weights, dynamic loss scaling, and the learning-rate schedule.

With `precision.compute` fp32 the model parameters are their own masters; with bf16/fp16 the
model holds low-precision compute copies and this module keeps fp32 masters beside them
(Micikevicius et al. 2018, "Mixed Precision Training"): gradients are up-cast, unscaled,
clipped and applied in fp32, then the updated masters are copied back into the compute copies.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.config import Config
from shardwise.errors import ConfigError


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


# bitsandbytes' block-wise 8-bit optimizers quantise each state tensor in blocks of this many
# elements (one fp32 absmax each): a shard that starts on a block boundary of its parameter
# holds exactly the single-process blocks, so ZeRO aligns shards to it (parallel/zero.py)
QUANT_BLOCK = 256
# bitsandbytes' block-wise 8-bit AdamW, and its paged variant: the same update, its state in
# CUDA unified memory that the driver pages out to the host under GPU memory pressure
EIGHT_BIT = ("adamw8bit", "paged_adamw8bit")


def adamw(
    decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: Config
) -> torch.optim.Optimizer:
    """AdamW with the config's hyper-parameters; weight decay only on `decay`. torch's fused
    implementation: one pass over parameter, gradient and both moments per element (on one CPU
    thread 5x faster than the foreach one, which makes ~12 passes); or bitsandbytes' 8-bit one
    (optim.name=adamw8bit). The PyTorch peers build theirs here too, so they train the same
    recipe."""
    o = cfg.optim
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if o.name in EIGHT_BIT:
        return adamw8bit(groups, cfg)
    return torch.optim.AdamW(
        groups, lr=cfg.train.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True
    )


def quiet_bitsandbytes() -> None:
    """bitsandbytes logs at import (peft imports it too), on CPUs with AVX-512 BF16, that it
    cannot download an optional 4-bit matmul kernel: a hub fetch, and a warning about nothing
    shardwise uses."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def adamw8bit(groups: list[dict], cfg: Config) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW8bit (or PagedAdamW8bit), block-wise, every tensor in 8 bits
    (min_8bit_size=0: the 32-bit fallback for small tensors would decide by the size of a
    rank's shard, so by the layout). Paged on a CPU is the same optimizer (nothing to page to:
    `explain`, and so `train`, say it once; bitsandbytes' own per-tensor warning is muted)."""
    quiet_bitsandbytes()
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError(
            f"optim.name={cfg.optim.name} is bitsandbytes' 8-bit AdamW, and bitsandbytes is "
            "not installed. Fix: pip install 'shardwise[finetune]' (or bitsandbytes), or "
            "--optim.name=adamw."
        ) from None
    o = cfg.optim
    kind = bnb.optim.PagedAdamW8bit if o.name == "paged_adamw8bit" else bnb.optim.AdamW8bit
    warnings.filterwarnings("ignore", "Paged optimizers are not supported on CPU")
    return kind(groups, lr=cfg.train.lr, betas=(o.beta1, o.beta2), eps=o.eps, min_8bit_size=0)


def replicated_targets(model: nn.Module) -> list[Target]:
    """Data parallelism: every parameter, its gradient in the bucket view `main_grad`.
    No weight decay on gains and biases (1-D), as in GPT-2/LLaMA training recipes."""
    return [
        Target(p, (lambda p=p: p.main_grad), p.ndim >= 2, getattr(p, "tp_kind", "replica"), name)
        for name, p in model.named_parameters()
        if p.requires_grad
    ]


class MixedPrecisionAdamW:
    """One level of composition: fp32 masters + torch.optim.AdamW + clipping + loss scale.

    `sum_over_shards` adds up partial squared norms when each rank holds only a shard of the
    gradients; it receives [squared norm of tp-sharded targets, of the others] (ZeRO sums
    both over dp, tensor parallelism the first over tp). `reduce_partial` sums the gradients
    of `partial` targets over tp. `after_step` publishes updated compute copies (e.g.
    all-gathers them)."""

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
        self.params = [t.param for t in targets]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        # Offload (ZeRO-Offload, Ren et al. 2021): fp32 masters and Adam state live in host
        # memory and the update runs on the CPU; only gradients go down, parameters come up.
        # `nvme` (folder, rank): they live on local disk instead, streamed through two host
        # slots (optim/nvme.py; ZeRO-Infinity).
        self.offload = offload or nvme is not None
        self.separate_master = self.offload or any(p.dtype != torch.float32 for p in self.params)
        self.nvme = None
        if nvme is not None:
            from shardwise.optim.nvme import NvmeAdamW, chunk_elements

            chunk = chunk_elements(cfg.memory.nvme_buffer_mb)
            self.nvme = NvmeAdamW(nvme[0], nvme[1], [p.shape for p in self.params], chunk)
            self.masters = self.nvme.masters
            self._index = {id(m): i for i, m in enumerate(self.masters)}
            for m, p in zip(self.masters, self.params, strict=True):
                m.copy_(p.detach())
            self.nvme_step, self.lr = 0, cfg.train.lr
            self.decay = [cfg.optim.weight_decay if t.decay else 0.0 for t in targets]
            self.hyper = (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps)
        elif self.separate_master:
            host = torch.device("cpu") if offload else None
            self.masters = [
                _host_copy(p) if host else p.detach().float().clone() for p in self.params
            ]
        else:
            self.masters = self.params
        decay = [m for m, t in zip(self.masters, targets, strict=True) if t.decay]
        no_decay = [m for m, t in zip(self.masters, targets, strict=True) if not t.decay]
        self.inner = adamw(decay, no_decay, cfg) if self.nvme is None else None
        self.grad_clip = cfg.optim.grad_clip
        self.sum_over_shards = sum_over_shards
        self.reduce_partial = reduce_partial
        self.after_step = after_step
        p = cfg.precision
        self.scaler = LossScaler(
            p.compute == "fp16", p.loss_scale if p.compute == "fp16" else 1.0, p.scale_window
        )

    @property
    def master_bytes(self) -> int:
        if self.nvme is not None:  # in host memory: the masters' row of the two slots
            return self.nvme.buffer_bytes // 3
        if not self.separate_master:
            return 0
        return sum(m.numel() * m.element_size() for m in self.masters)

    @property
    def disk_bytes(self) -> int:
        return self.nvme.disk_bytes if self.nvme is not None else 0

    def adam_steps(self) -> int:
        """AdamW's step count (the same for every tensor: a skipped step skips them all)."""
        if self.nvme is not None:
            return self.nvme_step
        for state in self.inner.state.values():
            return int(state["step"])
        return 0

    def close(self) -> None:
        """Release what lives outside the process (the NVMe state's folder)."""
        if self.nvme is not None:
            self.nvme.close()

    @property
    def state_bytes(self) -> int:
        if self.nvme is not None:  # the moments' rows of the two slots
            return self.nvme.buffer_bytes * 2 // 3
        seen: dict[int, int] = {}  # by storage: 8-bit AdamW shares its quantisation maps
        for state in self.inner.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    seen[v.untyped_storage().data_ptr()] = v.numel() * v.element_size()
        return sum(seen.values())

    # -- checkpoints: the moments as fp32 tensors, whatever the optimizer keeps -------------------
    def moments(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's two moments of `master` at fp32 (checkpoints store these for any optimizer,
        so they are layout-free and an 8-bit run resumes in any layout): torch's own state
        tensors, or bitsandbytes' 8-bit blocks dequantised (copies; `store_moments` writes
        edited copies back)."""
        if self.nvme is not None:  # views of the state on disk: a load writes them in place
            i = self._index[id(master)]
            return {"exp_avg": self.nvme.exp_avg[i], "exp_avg_sq": self.nvme.exp_avg_sq[i]}
        state = self.inner.state.get(master, {})
        if "state1" not in state:
            return {k: v for k, v in state.items() if k != "step"}
        from bitsandbytes.functional import dequantize_blockwise

        return {
            name: dequantize_blockwise(
                state[f"state{i}"],
                absmax=state[f"absmax{i}"],
                code=state[f"qmap{i}"],
                blocksize=QUANT_BLOCK,
            )
            for i, name in ((1, "exp_avg"), (2, "exp_avg_sq"))
        }

    def store_moments(self, master: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Quantise fp32 moments back into an 8-bit state (torch's: `moments` gave the state
        itself, nothing to do); exactly the state they were dequantised from when the blocks
        are cut alike (`requantise`)."""
        state = self.inner.state.get(master, {}) if self.inner is not None else {}
        if "state1" not in state:
            return
        for i, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
            codes, absmax = requantise(values[name].flatten(), state[f"qmap{i}"])
            state[f"state{i}"].copy_(codes.view_as(state[f"state{i}"]))
            state[f"absmax{i}"].copy_(absmax)

    def fresh_state(self, step: int) -> None:
        """Give every master zero moments and the step count `step` (before a checkpoint's
        moments are loaded into them)."""
        if self.nvme is not None:
            self.nvme.zero_moments()
            self.nvme_step = step
            return
        if not hasattr(self.inner, "init_state"):  # torch: through its own load_state_dict
            sd = self.inner.state_dict()
            params = [p for g in self.inner.param_groups for p in g["params"]]
            sd["state"] = {
                i: {
                    "step": torch.tensor(float(step)),  # a CPU scalar, as torch.optim makes it
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
                for i, p in enumerate(params)
            }
            self.inner.load_state_dict(sd)
            return
        for g, group in enumerate(self.inner.param_groups):  # bitsandbytes
            for i, p in enumerate(group["params"]):
                if p not in self.inner.state:
                    self.inner.init_state(group, p, g, i)
                self.inner.state[p]["step"] = step

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        for group in self.inner.param_groups if self.inner is not None else []:
            group["lr"] = lr

    @torch.no_grad()
    def step(self, skip: bool = False) -> StepResult:
        """Unscale, measure the global norm, clip and step; returns the norm and whether the
        step was skipped: a non-finite norm skips it on every rank alike, and so does `skip`
        (the caller saw a non-finite loss; every rank must pass the same value)."""
        if self.nvme is not None:  # stay where they are: the step takes them chunk by chunk
            grads = [t.grad() for t in self.targets]
        else:
            for t, m in zip(self.targets, self.masters, strict=True):
                g = t.grad()
                m.grad = g.to(m.device, torch.float32, non_blocking=True)
            grads = [m.grad for m in self.masters]
        if self.reduce_partial is not None:
            self.reduce_partial(
                [g for g, t in zip(grads, self.targets, strict=True) if t.tp == "partial"]
            )
        if grads and self.scaler.scale != 1.0:  # (a frozen pipeline stage has none)
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        # [tp-sharded, the rest]: over tp the first adds up, the second is counted once
        parts = torch.zeros(2, dtype=torch.float64)
        norms = torch.zeros(0, dtype=torch.float64)  # squared, per target
        if grads:
            # fp64 accumulation: an fp32 norm of a large tensor is off by ~1e-6 relative, and by
            # a different amount when the tensor is cut into other shards (layout invariance)
            norms = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64)).square()
            sharded = torch.tensor([t.tp == "shard" for t in self.targets], device=norms.device)
            counted = torch.tensor([t.in_norm for t in self.targets], device=norms.device)
            norms = norms * counted
            parts = torch.stack([norms[sharded].sum(), norms[~sharded].sum()])
        parts = parts.to(self.device)  # collectives run on the compute device
        if self.sum_over_shards is not None:
            self.sum_over_shards(parts)
        norm_value = math.sqrt(
            float(parts.sum())
        )  # the step's one host sync: skip and clip need it
        finite = math.isfinite(norm_value)
        self.scaler.update(finite)
        if finite and not skip:
            if grads and self.grad_clip > 0 and norm_value > self.grad_clip:
                torch._foreach_mul_(grads, self.grad_clip / (norm_value + 1e-6))
            if self.nvme is not None:  # each chunk's masters go into their parameters
                b1, b2, eps = self.hyper
                self.nvme.step(grads, self.params, self.decay, self.nvme_step, self.lr, b1, b2, eps)
                self.nvme_step += 1
            else:
                self.inner.step()
                if self.offload:
                    for p, m in zip(self.params, self.masters, strict=True):
                        p.copy_(m, non_blocking=True)
                elif self.separate_master:
                    torch._foreach_copy_(self.params, self.masters)
            if self.after_step is not None:
                self.after_step()
        for m in self.masters:
            m.grad = None
        bad = ()
        if not finite:  # name the culprits (one more sync, on skipped steps only)
            flags = (~torch.isfinite(norms)).tolist()
            bad = tuple(t.name for t, f in zip(self.targets, flags, strict=True) if f)
        return StepResult(norm_value, not finite or skip, bad)


def requantise(v: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax per QUANT_BLOCK block) of values `v` that were dequantised from a
    block-wise 8-bit state with the map `code`, recovering that state exactly. Quantising
    afresh would not: a block's largest magnitude, if negative, was stored as the map's most
    negative code (-0.993 for bitsandbytes' signed map, not -1), so its dequantised value is
    below the absmax it came from; each value divided by the extreme code of its sign gives
    back that absmax (the largest such quotient), then each value its nearest code."""
    n, bs = v.numel(), QUANT_BLOCK
    blocks = torch.zeros(-(-n // bs) * bs, dtype=torch.float32, device=v.device)
    blocks[:n] = v
    blocks = blocks.view(-1, bs)
    hi, lo = code.max(), code.min()
    implied = torch.where(blocks > 0, blocks / hi, torch.zeros_like(blocks))
    if lo < 0:
        implied = torch.where(blocks < 0, blocks / lo, implied)
    absmax = implied.max(dim=1).values
    norm = (blocks / absmax[:, None].clamp_min(torch.finfo(torch.float32).tiny)).flatten()
    order = torch.argsort(code)
    ordered = code[order]
    i = torch.searchsorted(ordered, norm).clamp(1, len(code) - 1)
    nearer_left = (norm - ordered[i - 1]).abs() <= (ordered[i] - norm).abs()
    return order[torch.where(nearer_left, i - 1, i)][:n].to(torch.uint8), absmax


def _host_copy(p: torch.Tensor) -> torch.Tensor:
    """An fp32 copy in host memory, pinned when the parameter is on a GPU so the copies back
    and forth can overlap with compute."""
    out = torch.empty(
        p.shape, dtype=torch.float32, device="cpu", pin_memory=p.device.type == "cuda"
    )
    out.copy_(p.detach())
    return out


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
