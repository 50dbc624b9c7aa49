"""`shardwise explain`: every derived value of a config, without starting training.

Model-state bytes are exact (from the parameter count and dtypes). Activation bytes are
measured, not estimated: one forward and loss of a micro-batch run on fake tensors (shapes and
dtypes only: no memory, no compute, but the same kernel choices as the real device, which the
meta device does not make for attention) under the saved-tensor hooks the engine uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise import device as dev
from shardwise.config import Config
from shardwise.memory import ActivationMeter, step_memory, tensor_bytes
from shardwise.metrics import human_bytes
from shardwise.models import build_model, count_params
from shardwise.parallel.zero_units import unit_roots
from shardwise.recompute import apply_recompute
from shardwise.runtime import cast_for_compute, freeze
from shardwise.validate import derive


def _bytes(precision: str) -> int:
    return torch.tensor([], dtype=dev.dtype_of(precision)).element_size()


def model_states(model: nn.Module, cfg: Config, dp: int) -> dict[str, int]:
    """Device (and, with offload, host) model-state bytes per rank; see `_states`."""
    states = _states(model, cfg, dp)
    offload = cfg.memory.offload
    if offload != "none":  # offloaded masters and Adam state: a host budget of their own
        states["host_master"] = states["master"]
        states["host_optimizer"] = states["optimizer"]
        states["master"] = states["optimizer"] = 0
    if offload == "optimizer+params":
        states["host_params"] = states["params"]
        states["params"] = 0
    return states


def _states(model: nn.Module, cfg: Config, dp: int) -> dict[str, int]:
    """Exact model-state bytes of rank 0 (the largest: its slices hold no padding) for the
    configured ZeRO stage, from the same unit layout the engine builds."""
    bc, br = _bytes(cfg.precision.compute), _bytes(cfg.precision.reduce)
    fp32_master = cfg.precision.compute != "fp32" or cfg.memory.offload != "none"
    stage, master = cfg.parallel.zero, 4 if fp32_master else 0
    buffers = tensor_bytes(model.buffers())
    if stage == 0:
        n = count_params(model)
        tensors = len([p for p in model.parameters() if p.requires_grad])
        # AdamW: two fp32 moments per parameter and one fp32 step count per tensor
        return {
            "params": n * bc,
            "grads": n * br,
            "master": master * n,
            "optimizer": 8 * n + 4 * tensors,
            "buffers": buffers,
        }
    padded = 0
    own = [0] * dp  # parameter elements in rank r's slices (the last rank's hold padding)
    pieces = [0] * dp  # parameter pieces there: AdamW keeps a step counter for each
    gathered = []
    for _, entries, _ in unit_roots(model):
        offsets = _offsets(entries)
        numel = sum(p.numel() for *_, p in entries)
        shard = -(-numel // dp)
        padded += shard * dp
        gathered.append(shard * dp)
        for r in range(dp):
            lo, hi = r * shard, (r + 1) * shard
            own[r] += max(0, min(hi, numel) - lo)
            pieces[r] += sum(
                1
                for (*_, p), off in zip(entries, offsets, strict=True)
                if off < hi and off + p.numel() > lo
            )
    two = sum(sorted(gathered)[-2:])
    # ZeRO-3 holds up to two gathered units (compute dtype) and two in-flight gradient
    # buffers (reduce dtype); ZeRO-2 only the gradient buffers. An estimate, not a count.
    transient = {1: 0, 2: two * br, 3: two * (bc + br)}[stage]
    return {
        "params": (padded if stage < 3 else padded // dp) * bc,
        "grads": (padded if stage == 1 else padded // dp) * br,
        "master": master * max(own),
        "optimizer": max(8 * o + 4 * c for o, c in zip(own, pieces, strict=True)),
        "buffers": buffers + transient,
    }


def _offsets(entries) -> list[int]:
    sizes = [p.numel() for *_, p in entries]
    return [sum(sizes[:i]) for i in range(len(sizes))]


def predicted_memory(cfg: Config, derived) -> tuple[int, dict[str, int]]:
    """(parameter count, per-rank bytes by category)."""
    compute = cfg.precision.compute
    with FakeTensorMode():
        model = build_model(derived.spec)
        freeze(model, cfg.train.freeze)
        n = count_params(model)
        states = model_states(model, cfg, derived.dp)
        apply_recompute(model, derived.family, cfg.memory.recompute)
        cast_for_compute(model, dev.dtype_of(compute))
        meter = ActivationMeter(model)
        b = derived.micro_batch
        if derived.family == "resnet":
            size = cfg.data.image_size
            inputs = torch.zeros(
                b, derived.spec.in_channels, size, size, dtype=dev.dtype_of(compute)
            )
            targets = torch.zeros(b, dtype=torch.long)
        else:
            inputs = torch.zeros(b, cfg.data.seq_len, dtype=torch.long)
            targets = torch.zeros(b, cfg.data.seq_len, dtype=torch.long)
        with meter.measure():
            logits = model(inputs)
            F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")
    return n, step_memory(states, meter.take_peak())


def predicted_comm(cfg: Config, derived, n: int, padded: int) -> dict[str, float]:
    """Ring-equivalent bytes per rank per step over dp (DESIGN.md accounting)."""
    d, ring = derived.dp, (derived.dp - 1) / derived.dp
    bc, br = _bytes(cfg.precision.compute), _bytes(cfg.precision.reduce)
    m = derived.micro_batches
    stage = cfg.parallel.zero
    dp_bytes = (
        {
            0: 2 * ring * n * br,  # one all-reduce of every gradient per step
            1: ring * padded * (br + bc),  # reduce-scatter once + all-gather of updated slices
            2: ring * padded * (m * br + bc),  # reduce-scatter every micro-batch
            3: ring * padded * m * (br + 2 * bc),  # + gather before forward and before backward
        }[stage]
        if d > 1
        else 0.0
    )
    return {"dp": dp_bytes, "tp": 0.0, "pp": 0.0}


def padded_params(cfg: Config, derived) -> int:
    with FakeTensorMode():
        model = build_model(derived.spec)
        return sum(
            -(-sum(p.numel() for *_, p in e) // derived.dp) * derived.dp
            for _, e, _ in unit_roots(model)
        )


def explain_record(cfg: Config, world: int) -> dict:
    d = derive(cfg, world)
    n, mem = predicted_memory(cfg, d)
    return {
        "world": world,
        "pp": d.pp,
        "dp": d.dp,
        "tp": d.tp,
        "zero": cfg.parallel.zero,
        "model": cfg.model.name,
        "arch": d.spec.arch,
        "params": n,
        "n_layers": d.spec.n_layers,
        "dim": d.spec.dim,
        "global_batch": cfg.train.global_batch,
        "micro_batch": d.micro_batch,
        "micro_batches_per_step": d.micro_batches,
        "tokens_per_step": d.tokens_per_step,
        "precision": cfg.precision.compute,
        "reduce": cfg.precision.reduce,
        "recompute": cfg.memory.recompute,
        "dataset": cfg.data.dataset,
        "seq_len": cfg.data.seq_len,
        "steps": cfg.train.steps,
        "mem_bytes": mem,
        "comm_bytes": predicted_comm(cfg, d, n, padded_params(cfg, d)),
    }


def print_plan(r: dict) -> None:
    """The short plan `train` prints before it starts."""
    print(
        f"shardwise: {r['model']} ({r['params'] / 1e6:.2f}M params) on {r['world']} rank(s): "
        f"pp={r['pp']} dp={r['dp']} tp={r['tp']} zero={r['zero']} | global batch "
        f"{r['global_batch']} = {r['micro_batch']} x {r['micro_batches_per_step']} micro x "
        f"{r['dp']} dp | {r['tokens_per_step']:,} tokens/step | {r['precision']} | "
        f"predicted memory/rank {human_bytes(r['mem_bytes']['total'])}",
        flush=True,
    )


def print_explain(r: dict) -> None:
    rows = [
        ("world size", r["world"]),
        ("mesh", f"pp={r['pp']} x dp={r['dp']} x tp={r['tp']}"),
        ("zero stage", r["zero"]),
        ("model", f"{r['model']} ({r['arch']})"),
        ("parameters", f"{r['params']:,}"),
        ("layers / hidden size", f"{r['n_layers']} / {r['dim']}"),
        ("global batch", r["global_batch"]),
        ("micro batch", r["micro_batch"]),
        ("micro-batches per step (accumulation)", r["micro_batches_per_step"]),
        ("tokens per step", f"{r['tokens_per_step']:,}"),
        ("compute / reduce precision", f"{r['precision']} / {r['reduce']}"),
        ("recompute", r["recompute"]),
        ("data", f"{r['dataset']} (seq_len {r['seq_len']})"),
        ("steps", r["steps"]),
        ("dp traffic per step/rank", human_bytes(r["comm_bytes"]["dp"])),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("memory per rank:")
    for key, value in r["mem_bytes"].items():
        print(f"  {key:<12} {human_bytes(value):>10}  ({value:,} B)")
