"""Where the optimizer's fp32 state lives and what updates it: torch's fused AdamW (or
bitsandbytes' 8-bit one) over masters on the compute device or in host memory (`TorchUpdate`;
ZeRO-Offload, Ren et al. 2021), or AdamW over masters and moments on local disk, chunk by
chunk (optim/nvme.py's `NvmeUpdate`; ZeRO-Infinity). MixedPrecisionAdamW (optim/__init__.py)
unscales, measures and clips the gradients and hands them to one of them; both answer the same
questions (bytes held, moments for checkpoints, a fresh state to load into)."""

from __future__ import annotations

import logging
import warnings

import torch

from shardwise.config import Config
from shardwise.errors import ConfigError

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


class TorchUpdate:
    """fp32 masters (the parameters themselves when they are fp32 and on the device; copies,
    in host memory under `offload`) stepped by torch's AdamW or bitsandbytes' 8-bit AdamW,
    then copied into the parameters."""

    def __init__(self, targets: list, cfg: Config, offload: bool) -> None:
        self.params = [t.param for t in targets]
        self.offload = offload
        self.separate_master = offload or any(p.dtype != torch.float32 for p in self.params)
        if self.separate_master:
            self.masters = [
                _host_copy(p) if offload else p.detach().float().clone() for p in self.params
            ]
        else:
            self.masters = self.params
        decay = [m for m, t in zip(self.masters, targets, strict=True) if t.decay]
        no_decay = [m for m, t in zip(self.masters, targets, strict=True) if not t.decay]
        self.inner = adamw(decay, no_decay, cfg)

    def take_grads(self, targets: list) -> list[torch.Tensor]:
        """The targets' gradients up-cast beside their masters (where the update runs)."""
        for t, m in zip(targets, self.masters, strict=True):
            m.grad = t.grad().to(m.device, torch.float32, non_blocking=True)
        return [m.grad for m in self.masters]

    def apply(self, grads: list[torch.Tensor]) -> None:
        """Step the masters by their (unscaled, clipped) gradients; publish them."""
        self.inner.step()
        if self.offload:
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m, non_blocking=True)
        elif self.separate_master:
            torch._foreach_copy_(self.params, self.masters)

    def release_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    @property
    def master_bytes(self) -> int:
        if not self.separate_master:
            return 0
        return sum(m.numel() * m.element_size() for m in self.masters)

    @property
    def state_bytes(self) -> int:
        seen: dict[int, int] = {}  # by storage: 8-bit AdamW shares its quantisation maps
        for state in self.inner.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    seen[v.untyped_storage().data_ptr()] = v.numel() * v.element_size()
        return sum(seen.values())

    disk_bytes = 0

    def adam_steps(self) -> int:
        for state in self.inner.state.values():
            return int(state["step"])
        return 0

    def quantised(self, master: torch.Tensor) -> bool:
        """Whether `master`'s moments are kept in 8 bits (`moments` gives dequantised copies)."""
        return "state1" in self.inner.state.get(master, {})

    def moments(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
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
        state = self.inner.state.get(master, {})
        if "state1" not in state:
            return
        for i, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
            codes, absmax = requantise(values[name].flatten(), state[f"qmap{i}"])
            state[f"state{i}"].copy_(codes.view_as(state[f"state{i}"]))
            state[f"absmax{i}"].copy_(absmax)

    def fresh_state(self, step: int) -> None:
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
        for group in self.inner.param_groups:
            group["lr"] = lr

    def close(self) -> None:
        pass


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
