"""Our tensor parallelism against PyTorch's DTensor tensor parallelism, side by side.

What it measures: on 2 gloo ranks in fp32 (tp = 2, dp = 1), the same decoder, data order,
seed, AdamW settings, schedule and clipping are trained by shardwise (`parallel/tensor.py`,
vocabulary-parallel loss) and by `support.tp_peers:dtensor_peer` (DTensor
`parallelize_module` with ColwiseParallel/RowwiseParallel and its `loss_parallel`). All cases
run in ONE spawned world, interleaved A B, B A, ... so drift on a shared machine hits both
alike. Per case: the median step time over the steps after warm-up (max over ranks per
step); per size: the median over rounds and the ratio ours/DTensor of those medians (target
<= 1.00, limit 1.15; with --gate exit status 1 above it), the median of the per-round ratios
and the fastest-step ratio as cross-checks, our tp bytes per step against the formula, and
the largest loss difference (both must train the same thing).
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import (
    WARMUP_STEPS,
    abba_cases,
    add_smoke,
    check,
    command_line,
    commit,
    load,
    mb,
    median,
    round_medians,
    table,
)
from shardwise.launchers.harness import run_world

NPROC = 2
DTENSOR = "support.tp_peers:dtensor_peer"
SIZES = {  # name -> model overrides
    "L4 d256": ["--model.n_layers=4", "--model.dim=256", "--model.ffn_dim=704"],
    "L4 d512": ["--model.n_layers=4", "--model.dim=512", "--model.ffn_dim=1408"],
}
SEQ, BATCH = 128, 8


def overrides(size: str, steps: int) -> list[str]:
    return [
        "--model.name=tiny",
        *SIZES[size],
        f"--data.seq_len={SEQ}",
        f"--train.global_batch={BATCH}",
        f"--train.steps={steps}",
        "--train.lr=1e-3",
        "--train.seed=0",
        "--optim.warmup_steps=5",
        "--train.eval_every=0",
        "--train.eval_batches=0",
        "--precision.compute=fp32",
        f"--parallel.tp={NPROC}",
    ]


def tp_formula(size: str) -> float:
    """Bytes per step per rank: L layers of 8bsh(t-1)/t, embedding and head 4bsh(t-1)/t,
    the loss's 6bs(t-1)/t; fp32. tp 2 divides the 2 kv heads: nothing else is reduced."""
    n_layers = int(SIZES[size][0].split("=")[1])
    h = int(SIZES[size][1].split("=")[1])
    ring = (NPROC - 1) / NPROC
    b, s = BATCH, SEQ
    return 4 * ring * (n_layers * 8 * b * s * h + 4 * b * s * h + 6 * b * s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per case (5 warm-up)")
    parser.add_argument("--rounds", type=int, default=4, help="repetitions (even: ABBA)")
    parser.add_argument("--gate", action="store_true", help="exit 1 if ours/DTensor > 1.15")
    parser.add_argument("--quick", action="store_true", help="first size, 2 rounds, 10 steps")
    add_smoke(parser)
    args = parser.parse_args()
    args.quick |= args.smoke
    sizes = list(SIZES)[:1] if args.quick else list(SIZES)
    steps = 2 if args.smoke else 10 if args.quick else args.steps
    rounds = 1 if args.smoke else 2 if args.quick else args.rounds
    print(f"$ {command_line()}")
    print(f"shardwise commit {commit()}, torch {torch.__version__}")
    for size in sizes:
        print(f"{size}: {' '.join(overrides(size, steps))}")
    print(
        f"{NPROC} ranks (tp={NPROC}), gloo, 1 thread each; step time: median of steps "
        f"{WARMUP_STEPS + 1}..{steps}, max over ranks, then median over {rounds} rounds"
    )
    print(f"load average at the start: {load()} (2 cores, shared)\n")

    pair = (("ours", {}), ("dtensor", {"peer": DTENSOR}))
    cases, keys = abba_cases(rounds, sizes, pair, lambda size: overrides(size, steps))
    results = run_world(NPROC, cases)
    check(results)
    by_key = dict(zip(keys, results, strict=True))

    rows, per_round, worst = [], [], 0.0
    for size in sizes:
        med, best, paired, lines = round_medians(
            by_key, size, ("ours", "dtensor"), rounds, "ours/DTensor"
        )
        per_round += lines
        ratio = median(med["ours"]) / median(med["dtensor"])
        worst = max(worst, ratio)
        ours0 = by_key[size, "ours", 0][0]
        ours_bytes = median([x["comm_bytes"]["tp"] for x in ours0["records"]])
        peer_losses = by_key[size, "dtensor", 0][0]["losses"]
        dloss = max(abs(a - b) for a, b in zip(ours0["losses"], peer_losses, strict=True))
        rows.append(
            [
                size,
                f"{median(med['ours']) * 1000:.1f}",
                f"{median(med['dtensor']) * 1000:.1f}",
                f"{ratio:.3f}",
                f"{median(paired):.3f}",
                f"{best['ours'] / best['dtensor']:.3f}",
                mb(ours_bytes),
                mb(tp_formula(size)),
                f"{dloss:.1e}",
            ]
        )
    header = ["size", "ours ms", "DTensor ms", "ours/DTensor", "median round ratio"]
    header += ["fastest-step ratio", "ours tp MB/step", "formula MB", "max abs dloss"]
    print(table(header, rows))
    print("\nper-round median step time (ms); odd rounds ran ours first, even DTensor first:")
    print(table(["size", "who", *(f"round {r + 1}" for r in range(rounds))], per_round))
    print(f"\nload average at the end: {load()}")
    verdict = "meets target" if worst <= 1.0 else "within limit" if worst <= 1.15 else "TOO SLOW"
    print(f"worst ours/DTensor {worst:.3f}: {verdict} (target <= 1.00, limit 1.15)")
    return 1 if args.gate and worst > 1.15 else 0


if __name__ == "__main__":
    sys.exit(main())
