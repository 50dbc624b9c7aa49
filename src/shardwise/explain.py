"""`shardwise explain`: every derived value of a config, without starting training.

Model-state bytes are exact (from the parameter count and dtypes). Activation bytes are
measured, not estimated: one forward of a micro-batch runs on the meta device (no memory, no
compute) under the same saved-tensor hooks that the engine uses while training."""

from __future__ import annotations

import torch

from shardwise import device as dev
from shardwise.config import Config
from shardwise.memory import ActivationMeter, step_memory, tensor_bytes
from shardwise.metrics import human_bytes
from shardwise.models import build_model, count_params
from shardwise.recompute import apply_recompute
from shardwise.validate import derive


def _bytes(precision: str) -> int:
    return torch.tensor([], dtype=dev.dtype_of(precision)).element_size()


def predicted_memory(cfg: Config, derived) -> tuple[int, dict[str, int]]:
    """(parameter count, per-rank bytes by category) for data parallelism (no sharding)."""
    with torch.device("meta"):
        model = build_model(derived.spec)
    n = count_params(model)
    compute, reduce = cfg.precision.compute, cfg.precision.reduce
    states = {
        "params": n * _bytes(compute),
        "grads": n * _bytes(reduce),
        "master": 0 if compute == "fp32" else 4 * n,
        "optimizer": 8 * n,  # AdamW: two fp32 moments per parameter
        "buffers": tensor_bytes(model.buffers()),
    }
    apply_recompute(model, derived.family, cfg.memory.recompute)
    model.to(dev.dtype_of(compute))
    meter = ActivationMeter(model)
    shape = (
        (derived.micro_batch, cfg.data.seq_len)
        if derived.family != "resnet"
        else (
            derived.micro_batch,
            derived.spec.in_channels,
            cfg.data.image_size,
            cfg.data.image_size,
        )
    )
    with torch.device("meta"):
        inputs = (
            torch.zeros(shape, dtype=torch.long)
            if derived.family != "resnet"
            else torch.zeros(shape, dtype=dev.dtype_of(compute))
        )
        with meter.measure():
            model(inputs).float().sum()
    return n, step_memory(states, meter.take_peak())


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
        "mem_bytes": mem,
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
        ("global batch", r["global_batch"]),
        ("micro batch", r["micro_batch"]),
        ("micro-batches per step (accumulation)", r["micro_batches_per_step"]),
        ("tokens per step", f"{r['tokens_per_step']:,}"),
        ("compute / reduce precision", f"{r['precision']} / {r['reduce']}"),
        ("recompute", r["recompute"]),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("memory per rank:")
    for key, value in r["mem_bytes"].items():
        print(f"  {key:<12} {human_bytes(value):>10}  ({value:,} B)")
