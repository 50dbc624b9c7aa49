"""What every peer shares with our training loop: the model, data, sampler, AdamW groups,
lr schedule and loss normalisation of `ddp_peer`, and the result record the parity tests and
benchmarks read. A peer supplies only its wrapping, its micro-step and its optimizer step."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.config import Config
from shardwise.data import GlobalSampler, load_data, split_for_rank
from shardwise.distributed import device as dev
from shardwise.finetune.lora import apply_lora
from shardwise.models import build_model, init_weights
from shardwise.optim import adamw, lr_at
from shardwise.training.runtime import data_spec, freeze, init_distributed
from shardwise.training.validate import Derived, derive
from support.collectives import CollectiveCounter


@dataclass
class Setup:
    cfg: Config
    d: Derived
    info: dev.DeviceInfo
    model: nn.Module
    data: object
    sampler: GlobalSampler
    rank_count: int  # tokens in this rank's part of the global batch: the loss normaliser


def setup(cfg: Config) -> Setup:
    """Model, data and sampler exactly as `ddp_peer` builds them (and `train.freeze`)."""
    unsupported = {
        "parallel.tp": (cfg.parallel.tp, 1),
        "parallel.pp": (cfg.parallel.pp, 1),
        "memory.offload": (cfg.memory.offload, "none"),
        "memory.recompute": (cfg.memory.recompute, "none"),
    }
    bad = {k: v for k, (v, plain) in unsupported.items() if v != plain}
    if bad:
        raise ValueError(f"these peers run plain data parallelism; unsupported: {bad}")
    info = init_distributed(cfg)  # a torch peer: writes nothing in run.dir, so no job_here lock
    d = derive(cfg, dist.get_world_size())
    data = load_data(data_spec(cfg, d.spec.vocab_size), "train")
    with torch.device(info.device):
        model = build_model(d.spec)
        apply_lora(model, cfg.finetune)  # peft's adapters, as the engine adds them
    init_weights(model, cfg.train.seed)  # (seed, name): every rank holds the same full model
    freeze(model, cfg.train.freeze)
    sampler = GlobalSampler(len(data), cfg.train.global_batch, cfg.train.seed)
    rank_count = cfg.train.global_batch // d.dp * d.tokens_per_sample
    return Setup(cfg, d, info, model, data, sampler, rank_count)


def peer_adamw(cfg: Config, params: list[nn.Parameter]) -> torch.optim.AdamW:
    """Our AdamW: weight decay only on matrices (ndim >= 2), fused implementation (optim.adamw)."""
    params = [p for p in params if p.requires_grad]
    return adamw([p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2], cfg)


def loss_sum(model: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="sum")


def to_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and aliases count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = to_local(t).untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return storage_bytes(
        v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)
    )


def train_loop(
    s: Setup,
    opt: torch.optim.Optimizer,
    micro_step: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor],
    optimizer_step: Callable[[], None],
    counter: CollectiveCounter,
) -> tuple[list[float], list[float], list[float]]:
    """The loop of `ddp_peer`: lr, micro-batches, step. `micro_step(x, y, i, n)` returns the
    detached rank-normalised loss of micro-batch i of n; collectives count inside the step.
    Returns the losses, the wall-clock and the process CPU time of every step."""
    losses, times, cpu = [], [], []
    for step in range(s.cfg.train.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s.cfg)
        t0, c0 = time.perf_counter(), time.process_time()
        micro = split_for_rank(
            s.sampler.global_indices(step), dist.get_rank(), s.d.dp, s.d.micro_batch
        )
        total = torch.zeros(())
        counter.active = True
        for i, idx in enumerate(micro):
            x, y = (t.to(s.info.device) for t in s.data.get_batch(idx))
            total += micro_step(x, y, i, len(micro)).cpu()
        optimizer_step()
        counter.active = False
        dev.synchronize(s.info)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        dist.all_reduce(total)
        losses.append(float(total) / s.d.dp)
    return losses, times, cpu


def result(losses, timing, params, state, counter: CollectiveCounter, steps: int) -> dict:
    times, cpu = timing
    return {
        "losses": losses,
        "params": params,
        "step_times": times,
        "step_cpu_times": cpu,  # CPU time of the whole process (gloo threads included)
        "state_bytes": state,
        "comm_bytes": counter.total / steps,
        "comm_by_op": {k: v / steps for k, v in counter.bytes.items()},
        "comm_calls": {k: v / steps for k, v in counter.calls.items()},
    }
