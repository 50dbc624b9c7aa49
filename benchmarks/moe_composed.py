"""MoE decoder under pipeline and tensor (+ sequence) parallelism, with and without expert
parallelism: model memory per rank, saved activations, traffic by mesh dimension and step time,
on 4 ranks.

A moe-tiny-shaped decoder with 8 experts of 176 (4 blocks, hidden 128, top-2, a 512-token
vocabulary), global batch 16 x seq 128, 2 micro-batches per dp rank, ZeRO-0, trains --steps
steps in each layout of one 4-rank world: dp 4 (the baseline), ep 4, pp 2 x dp 2,
ep 2 x pp 2, tp 2 + sp x dp 2 and ep 2 x tp 2 + sp. Printed per layout (max over ranks of the
engine's own accounting, metrics.jsonl `mem_bytes` of the last step): params, grads,
optimizer, saved activations; beside them explain's params; the bytes per step each mesh
dimension carried (mean over steps, slowest rank); the median steady step (slowest rank);
and the last loss's relative distance from dp 4's (layout invariance). On a CPU machine with
fewer cores than ranks the ranks share cores: the times show each layout's overheads here,
not a speed-up.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/moe_composed.py [--steps 8]
"""

from __future__ import annotations

import argparse
import sys

from common import add_smoke, check, mb, median, preamble, slowest_rank_steps, steady, table
from shardwise.config import load_config
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_world
from shardwise.plan.hardware import get_hardware
from support.compare import VOCAB

SHAPE = [
    "--model.name=moe-tiny",
    "--model.n_experts=8",
    f"--model.vocab_size={VOCAB}",  # the parity tests' cached BPE
    "--data.seq_len=128",
    "--train.eval_batches=0",
    "--train.eval_every=0",
    "--optim.warmup_steps=1",
]
SP = ["--parallel.tp=2", "--parallel.sp=true"]
LAYOUTS = {  # name: overrides (4 ranks)
    "dp 4": [],
    "ep 4": ["--parallel.ep=4"],
    "pp 2 x dp 2": ["--parallel.pp=2"],
    "ep 2 x pp 2": ["--parallel.pp=2", "--parallel.ep=2"],
    "tp 2 + sp x dp 2": SP,
    "ep 2 x tp 2 + sp": [*SP, "--parallel.ep=2"],
}
SMOKE = {"dp 2": [], "pp 2": ["--parallel.pp=2"], "tp 2 + sp": SP}
KEYS = ("params", "grads", "optimizer", "activations")
DIMS = ("dp", "tp", "pp", "ep")


def overrides(extra: list[str], steps: int, batch: int, dp: int) -> list[str]:
    return [
        *SHAPE,
        f"--train.global_batch={batch}",
        f"--train.micro_batch={batch // dp // 2}",  # 2 micro-batches per dp rank
        f"--train.steps={steps}",
        *extra,
    ]


def dp_of(extra: list[str], world: int) -> int:
    """world / (tp * pp)."""
    sizes = {x.split("=")[0]: int(x.split("=")[1]) for x in extra if x[-1].isdigit()}
    return world // (sizes.get("--parallel.tp", 1) * sizes.get("--parallel.pp", 1))


def measured(per_rank: list[dict]) -> dict:
    """Max over ranks of the last step's states and activations; per dimension the bytes per
    step of the slowest rank; the median steady step; the last loss."""
    last = [r["records"][-1] for r in per_rank]
    out = {k: max(x["mem_bytes"][k] for x in last) for k in KEYS}
    recs = [r["records"] for r in per_rank]
    for d in DIMS:
        out[d] = max(sum(x["comm_bytes"].get(d, 0) for x in rs) / len(rs) for rs in recs)
    steps = slowest_rank_steps(per_rank)
    out["step"] = median(steady(steps, min(3, len(steps) - 1)))
    out["loss"] = per_rank[0]["losses"][-1]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--world", type=int, default=4)
    add_smoke(ap)
    args = ap.parse_args()
    layouts, batch = LAYOUTS, 16
    if args.smoke:
        args.steps, args.world, layouts, batch = 2, 2, SMOKE, 8
    preamble()
    names = list(layouts)
    made = [overrides(layouts[n], args.steps, batch, dp_of(layouts[n], args.world)) for n in names]
    out = run_world(args.world, [{"overrides": x} for x in made])
    check(out)
    hw = get_hardware("cpu", calibrate=False)
    got = {n: measured(per_rank) for n, per_rank in zip(names, out, strict=True)}
    base = got[names[0]]
    rows = []
    for name, cfg_args in zip(names, made, strict=True):
        g = got[name]
        pred = explain_record(load_config(None, cfg_args), args.world, hw)["mem_bytes"]
        rows.append(
            [
                name,
                *(mb(g[k]) for k in KEYS),
                mb(pred["params"]),
                *(mb(g[d]) for d in DIMS),
                f"{g['step'] * 1000:.0f}",
                f"{abs(g['loss'] - base['loss']) / abs(base['loss']):.1e}",
            ]
        )
    print(f"\nper rank (max over ranks), {args.world} ranks, {args.steps} steps, ZeRO-0")
    header = ["layout", *KEYS, "explain params", *(f"{d} bytes/step" for d in DIMS)]
    print(table([*header, "step ms", f"last loss vs {names[0]}"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
