"""Expert parallelism: model memory per rank and the token exchange against ep, on 4 ranks.

For ep = 1, 2, 4 (dp 4; ZeRO-0 and ZeRO-3), a moe-tiny-shaped MoE decoder with 8 experts of 176
(2 blocks, hidden 128, top-2, a 512-token vocabulary), global batch 16 x seq 128, trains
--steps steps in one 4-rank world. Printed side by side:
(a) per rank (max over ranks, the engine's own accounting of metrics.jsonl `mem_bytes`) the
params, grads and optimizer bytes, and explain's prediction of each with its expert share;
(b) the exchange per step: the ep bytes comm.py counted (mean over steps, slowest rank) next
to the planner's balanced-routing formula (plan/traffic.ep_traffic), the calls, and the
seconds ranks spent blocked in ep collectives (`comm_wait_s.ep`, median over steady steps,
slowest rank) beside explain's exposed all-to-all time for this machine (plan/moe.ep_seconds:
the formula's bytes over the CPU entry's link, uncalibrated, plus a latency per call) and the
median step. On a CPU machine with fewer cores than ranks the ranks
share cores: the times show the exchange's cost here, not a speed-up.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/expert_parallel.py [--steps 12]
"""

from __future__ import annotations

import argparse
import sys

from common import add_smoke, check, median, preamble, slowest_rank_steps, steady, table
from shardwise.config import load_config
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_world
from shardwise.plan.hardware import get_hardware
from support.compare import VOCAB

SHAPE = [
    "--model.name=moe-tiny",
    "--model.n_layers=2",
    "--model.n_experts=8",
    f"--model.vocab_size={VOCAB}",  # the parity tests' cached BPE
    "--data.seq_len=128",
    "--train.global_batch=16",
    "--train.eval_batches=0",
    "--train.eval_every=0",
    "--optim.warmup_steps=1",
]
KEYS = ("params", "grads", "optimizer")


def overrides(ep: int, zero: int, steps: int, batch: int) -> list[str]:
    return [
        *SHAPE,
        f"--train.global_batch={batch}",
        f"--train.steps={steps}",
        f"--parallel.ep={ep}",
        f"--parallel.zero={zero}",
    ]


def measured(per_rank: list[dict]) -> dict:
    """Max over ranks of the last step's model states; the ep traffic of the slowest rank."""
    last = [r["records"][-1] for r in per_rank]
    out = {k: max(x["mem_bytes"][k] for x in last) for k in KEYS}
    recs = [r["records"] for r in per_rank]
    out["ep_bytes"] = max(sum(x["comm_bytes"].get("ep", 0) for x in rs) / len(rs) for rs in recs)
    out["ep_calls"] = max(x["comm_calls"].get("ep", 0) for x in last)
    per = [[s["comm_wait_s"].get("ep", 0) for s in rs] for rs in recs]
    waits = [max(x) for x in zip(*per, strict=True)]
    out["ep_wait"] = median(steady(waits, min(5, len(waits) - 1)))
    out["step"] = median(steady(slowest_rank_steps(per_rank), min(5, len(waits) - 1)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--world", type=int, default=4)
    add_smoke(ap)
    args = ap.parse_args()
    eps, zeros, batch = [1, 2, 4], [0, 3], 16
    if args.smoke:
        args.steps, args.world, eps, zeros, batch = 2, 2, [1, 2], [0], 4
    preamble()
    layouts = [(ep, z) for z in zeros for ep in eps]
    out = run_world(args.world, [{"overrides": overrides(*x, args.steps, batch)} for x in layouts])
    check(out)
    hw = get_hardware("cpu", calibrate=False)
    mem_rows, comm_rows = [], []
    for (ep, zero), per_rank in zip(layouts, out, strict=True):
        got = measured(per_rank)
        cfg = load_config(None, overrides(ep, zero, args.steps, batch))
        pred = explain_record(cfg, args.world, hw)
        experts = pred.get("expert_mem_bytes", {})
        for key in KEYS:
            want = pred["mem_bytes"][key]
            mem_rows.append(
                [ep, zero, key, f"{got[key]:,}", f"{want:,}", f"{experts.get(key, 0):,}"]
            )
        formula = pred["comm_bytes"].get("ep", 0.0)
        comm_rows.append(
            [
                ep,
                zero,
                f"{got['ep_bytes']:,.0f}",
                f"{formula:,.0f}",
                f"{got['ep_bytes'] / formula:.3f}" if formula else "-",
                f"{got['ep_calls']} / {pred['comm_calls'].get('ep', 0)}",
                f"{got['ep_wait'] * 1000:.1f}",
                f"{pred.get('time', {}).get('ep_exposed_s', 0.0) * 1000:.1f}",
                f"{got['step'] * 1000:.1f}",
            ]
        )
    print(f"\n(a) model states per rank (max over ranks), {args.world} ranks")
    header = ["ep", "zero", "state", "measured B", "explain B", "of which experts B"]
    print(table(header, mem_rows))
    print("\n(b) the token exchange per step (slowest rank)")
    header = [
        "ep",
        "zero",
        "ep bytes measured",
        "formula at balanced routing",
        "measured / formula",
        "calls measured / planned",
        "blocked in ep ms",
        "planned exposed ep ms",
        "step ms",
    ]
    print(table(header, comm_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
