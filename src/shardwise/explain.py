"""`shardwise explain`: every derived value of a config, without starting training.

Model-state bytes are exact (from the parameter count and dtypes). Activation bytes are
measured, not estimated: one forward and loss of a micro-batch run on fake tensors (shapes and
dtypes only: no memory, no compute, but the same kernel choices as the real device, which the
meta device does not make for attention) under the saved-tensor hooks the engine uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise import device as dev
from shardwise.config import Config
from shardwise.memory import ActivationMeter, step_memory, tensor_bytes
from shardwise.metrics import human_bytes
from shardwise.models import build_model, count_params
from shardwise.recompute import apply_recompute
from shardwise.runtime import cast_for_compute
from shardwise.validate import derive


def _bytes(precision: str) -> int:
    return torch.tensor([], dtype=dev.dtype_of(precision)).element_size()


def predicted_memory(cfg: Config, derived) -> tuple[int, dict[str, int]]:
    """(parameter count, per-rank bytes by category) for data parallelism (no sharding)."""
    compute, reduce = cfg.precision.compute, cfg.precision.reduce
    with FakeTensorMode():
        model = build_model(derived.spec)
        n = count_params(model)
        n_tensors = len([p for p in model.parameters() if p.requires_grad])
        states = {
            "params": n * _bytes(compute),
            "grads": n * _bytes(reduce),
            "master": 0 if compute == "fp32" else 4 * n,
            # AdamW: two fp32 moments per parameter and one fp32 step count per tensor
            "optimizer": 8 * n + 4 * n_tensors,
            "buffers": tensor_bytes(model.buffers()),
        }
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
        # all-reduce of every gradient once per step: 2(n-1)/n of the gradient bytes per rank
        "comm_bytes": {
            "dp": 2 * (d.dp - 1) / d.dp * n * _bytes(cfg.precision.reduce),
            "tp": 0.0,
            "pp": 0.0,
        },
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
        ("gradient all-reduce per step/rank", human_bytes(r["comm_bytes"]["dp"])),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("memory per rank:")
    for key, value in r["mem_bytes"].items():
        print(f"  {key:<12} {human_bytes(value):>10}  ({value:,} B)")
