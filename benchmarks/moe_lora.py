"""LoRA on experts: model states per rank and step time against full fine-tuning, on 4 ranks.

A moe-tiny-shaped MoE decoder with 8 experts of 176 (2 blocks, hidden 128, top-2, a 512-token
vocabulary), global batch 16 x seq 128, fp32, --steps steps in one 4-rank world, for ep 1 and 2
(dp 4) under ZeRO-0 and ZeRO-3: full fine-tuning next to LoRA rank 8 on the experts (a pair
per expert, models/expert_lora.py) and the attention's wq, wv. Printed per layout: the params,
grads and optimizer bytes per rank (max over ranks, metrics.jsonl `mem_bytes`) beside
explain's prediction (from the real model's units) and the planner's formula's (no model
built, as `shardwise plan` prices the preset), the median steady step of the slowest rank,
and the last loss. On a CPU
machine with fewer cores than ranks the ranks share cores: times compare layouts within this
run only.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/moe_lora.py [--steps 12]
"""

from __future__ import annotations

import argparse
import sys

from common import add_smoke, check, median, preamble, slowest_rank_steps, steady, table
from shardwise.config import load_config
from shardwise.job.describe import job_from_config, layout_from_config
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_world
from shardwise.plan.hardware import get_hardware
from shardwise.plan.search import evaluate
from shardwise.training.validate import derive
from support.compare import VOCAB

SHAPE = [
    "--model.name=moe-tiny",
    "--model.n_layers=2",
    "--model.n_experts=8",
    f"--model.vocab_size={VOCAB}",  # the parity tests' cached BPE
    "--data.seq_len=128",
    "--train.eval_batches=0",
    "--train.eval_every=0",
    "--optim.warmup_steps=1",
]
LORA = [
    "--finetune.lora_rank=8",
    "--finetune.lora_alpha=16",
    "--finetune.lora_targets=experts,wq,wv",
]
KEYS = ("params", "grads", "optimizer")


def overrides(ep: int, zero: int, lora: bool, steps: int, batch: int) -> list[str]:
    return [
        *SHAPE,
        f"--train.global_batch={batch}",
        f"--train.steps={steps}",
        f"--parallel.ep={ep}",
        f"--parallel.zero={zero}",
        *(LORA if lora else []),
    ]


def formula(cfg, world: int, hw) -> dict:
    """The planner's formula's `mem_bytes` for `cfg` (the spec's units, no model built)."""
    d = derive(cfg, world)
    return evaluate(job_from_config(cfg, hw, world, d.spec), layout_from_config(cfg, d))[
        "mem_bytes"
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--world", type=int, default=4)
    add_smoke(ap)
    args = ap.parse_args()
    eps, zeros, batch = [1, 2], [0, 3], 16
    if args.smoke:
        args.steps, args.world, eps, zeros, batch = 2, 2, [2], [0], 4
    preamble()
    layouts = [(ep, z, lora) for z in zeros for ep in eps for lora in (False, True)]
    cases = [{"overrides": overrides(*x, args.steps, batch)} for x in layouts]
    out = run_world(args.world, cases)
    check(out)
    hw = get_hardware("cpu", calibrate=False)
    rows = []
    for (ep, zero, lora), per_rank in zip(layouts, out, strict=True):
        last = [r["records"][-1] for r in per_rank]
        cfg = load_config(None, overrides(ep, zero, lora, args.steps, batch))
        pred = explain_record(cfg, args.world, hw)["mem_bytes"]
        plan = formula(cfg, args.world, hw)
        states = [
            f"{max(x['mem_bytes'][k] for x in last):,} / {pred[k]:,} / {plan[k]:,}" for k in KEYS
        ]
        warm = min(5, args.steps - 1)
        step = median(steady(slowest_rank_steps(per_rank), warm))
        kind = "LoRA r8 experts,wq,wv" if lora else "full"
        rows.append([ep, zero, kind, *states, f"{step * 1000:.1f}", f"{last[0]['loss']:.5f}"])
    print(
        f"\nmodel states per rank (max over ranks) measured / explain / formula, {args.world} ranks"
    )
    header = ["ep", "zero", "tuning", *(f"{k} B" for k in KEYS), "step ms", "last loss"]
    print(table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
