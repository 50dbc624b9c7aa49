"""One GPU, one command: how fast shardwise trains a decoder, eager and compiled, beside plain
PyTorch AMP and the planner's prediction.

What it measures, on one CUDA device: `shardwise train` of a decoder (default the 1b preset,
1.35B parameters, seq 2048, bf16) with `train.compile=false` and `train.compile=blocks`; the
same model trained by a plain PyTorch loop (`torch.autocast(bf16)` over fp32 parameters, fused
AdamW: benchmarks/cuda_profile.py's peer); and `shardwise explain`'s prediction for the config.
Per run: the median step after the warm-up steps, MFU under two FLOP conventions (shardwise's
6N + 12·L·h·s per token, attention included, and the 6N of the scaling-law papers), the
allocator's peak (`max_memory_allocated`), and the ratios to the peer. `--llama3-layers K`
runs a Llama-3-8B-shaped decoder instead (its widths: dim 4096, 32 heads, 8 kv heads, ffn
14336) trimmed to K layers to fit one card, on the data's own vocabulary. Where the card has
FP8 tensor cores (compute capability 8.9+: H100, H200, L40S) four more runs train with
`precision.fp8=tensorwise` and `rowwise` (torchao float8: the blocks' linear layers in FP8),
eager and with compiled blocks (where inductor fuses the casts into their neighbours);
the MFU columns keep the bf16 peak as denominator, so an FP8 run's MFU above the bf16 run's
is its speed-up. `--row FILE` appends each shardwise run as a row of the published record.
`--smoke` runs the tiny preset a few steps on whatever device there is (CPU here, FP8 in
numerics mode: emulated): it shows the script runs, its numbers mean nothing.

    .venv/bin/python benchmarks/cuda_speed.py [--model 1b] [--seq 2048] [--micro 4]
        [--global-batch 8] [--steps 5] [--warmup 3] [--llama3-layers 8] [--row FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from common import add_smoke, preamble, table
from cuda_profile import (
    _gb,
    _pct,
    add_run_args,
    overrides,
    peer,
    predicted,
    published_row,
    shardwise,
)

ENGINES = [("eager", "false", "none"), ("compiled blocks", "blocks", "none")]
FP8 = [
    ("eager + FP8 tensorwise", "false", "tensorwise"),
    ("eager + FP8 rowwise", "false", "rowwise"),
    ("compiled + FP8 tensorwise", "blocks", "tensorwise"),
    ("compiled + FP8 rowwise", "blocks", "rowwise"),
]
LLAMA3 = ["--model.dim=4096", "--model.n_heads=32", "--model.n_kv_heads=8", "--model.ffn_dim=14336"]


def config(a: argparse.Namespace, folder: Path) -> list[str]:
    shape = [f"--model.n_layers={a.llama3_layers}", *LLAMA3] if a.llama3_layers else []
    return [*overrides(a, folder), *shape]


def attention_share(a: argparse.Namespace, folder: Path) -> float:
    """12·L·h·s / (6N + 12·L·h·s): the part of shardwise's per-token FLOPs that attention's
    scores and mixing add to the 6N convention."""
    from shardwise.config import load_config
    from shardwise.models import build_model, count_params
    from shardwise.training.validate import derive

    spec = derive(load_config(None, config(a, folder)), 1).spec
    with torch.device("meta"):
        n = count_params(build_model(spec))
    attn = 12 * spec.n_layers * spec.dim * a.seq
    return attn / (6 * n + attn)


def engines(smoke: bool) -> list[tuple[str, str, str]]:
    """The runs: eager and compiled blocks, and FP8 where the card has FP8 tensor cores (on a
    CPU under --smoke: emulated, so the smoke run covers the FP8 path too)."""
    from shardwise.distributed import device as dev

    cap = dev.capability(dev.detect())
    if cap is None:  # a CPU: one emulated FP8 run under --smoke (each run costs the suite ~8 s)
        return ENGINES + (FP8[:1] if smoke else [])
    return ENGINES + (FP8 if cap >= dev.FP8_CAPABILITY else [])


def train(a: argparse.Namespace, folder: Path, compile_mode: str, fp8: str = "none") -> dict:
    """One `shardwise train` run: median step after the warm-up, MFU and peak allocation."""
    steps = a.warmup + a.steps
    run = [*config(a, folder), f"--train.compile={compile_mode}", f"--train.steps={steps}"]
    run.append(f"--precision.fp8={fp8}")
    shardwise(["train", *run, "--nproc=1", "--log.progress=off", "--log.tensorboard=false"])
    every = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in every if r["step"] > a.warmup]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in records),
        "mfu": statistics.median(r["mfu"] for r in records) if records[0]["mfu"] else None,
        "peak_bytes": max(r["mem_bytes"].get("device_peak", 0) for r in records) or None,
        "breaks": every[0].get("compile", {}).get("graph_breaks"),  # the first step says
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, warmup=3)  # the first steps compile
    p.add_argument("--llama3-layers", type=int, default=0, help="a trimmed Llama-3-8B shape")
    p.add_argument("--row", type=Path, help="append each shardwise run as a published row")
    add_smoke(p)
    a = p.parse_args()
    if a.smoke:
        a.model, a.seq, a.micro, a.global_batch, a.steps, a.warmup = "tiny", 64, 2, 4, 2, 1
        a.llama3_layers = 0
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/cuda_speed.py needs a CUDA device (or --smoke).")
    preamble()
    root = Path(tempfile.mkdtemp(prefix="cuda-speed-"))
    plan = predicted(a, root / "explain")
    share = attention_share(a, root)
    kinds = engines(a.smoke)
    runs = {name: train(a, root / f"{mode}-{fp8}", mode, fp8) for name, mode, fp8 in kinds}
    them = peer(a, root / "peer", a.warmup + a.steps)
    shape = f"Llama-3-8B widths, {a.llama3_layers} layers" if a.llama3_layers else a.model
    print(f"device: {them['device']}; model {shape}, seq {a.seq}, micro {a.micro}, "
          f"global batch {a.global_batch}, {a.precision}; attention {share:.1%} of the "
          "6N+12Lhs FLOPs")  # fmt: skip
    rows = []
    for name, r in [*runs.items(), ("PyTorch AMP (peer)", them)]:
        mfu = r["mfu"]
        rows.append([
            name, f"{r['step_s'] * 1e3:.1f}", _pct(mfu), _pct(mfu * (1 - share) if mfu else None),
            _gb(r["peak_bytes"]), f"{r['step_s'] / them['step_s']:.3f}",
            "-" if r.get("breaks") is None else str(r["breaks"]),
        ])  # fmt: skip
    rows.append([
        "planner (explain, eager)", f"{plan['step_time_s'] * 1e3:.1f}", _pct(plan.get("mfu")),
        "", _gb(plan["mem_bytes"]["total"]), f"{plan['step_time_s'] / them['step_s']:.3f}", "",
    ])  # fmt: skip
    header = ["run", "step ms", "MFU 6N+12Lhs", "MFU 6N", "peak", "/ peer", "graph breaks"]
    print(table(header, rows))
    for (name, *_), r, cells in zip(kinds, runs.values(), rows, strict=False):
        if a.row:
            row = published_row(a, r["step_s"], r["mfu"], r["peak_bytes"], them["device"], cells)
            row["source"] = row["source"].replace("cuda_profile.py", f"cuda_speed.py ({name})")
            with a.row.open("a") as f:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            print(f"published row {row['id']} ({name}) appended to {a.row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
