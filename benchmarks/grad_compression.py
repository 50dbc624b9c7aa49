"""Gradient compression (`parallel.grad_compression`) against PyTorch DDP's hooks, side by side.

What it measures: on 2 gloo ranks in fp32, the same decoder, data order, seed and AdamW
settings trained by shardwise with no compression, an fp16 wire and rank-r PowerSGD, and by
torch's DistributedDataParallel with its default all-reduce, `fp16_compress_hook` and
`powerSGD_hook` (PowerSGDState with the same rank, warm start and error feedback; DDP's
hook runs plain all-reduces for its first 2 steps, ours compresses from step 1). All cases
run in ONE spawned world, in rounds of alternating order. Per case: the median step time
after warm-up (slowest rank per step); per engine the median over rounds; the ratios ours /
DDP for each compression and compressed / uncompressed within each engine; our gradient
bytes per step and rank (`comm_bytes["dp"]`); the mean loss of the last 10 steps of each.
Why: compression is worth having only if it trains as well as DDP's and costs less time on
a slow link; on this machine's loopback the link is not slow, so the time ratios mostly
show the compression's own compute cost.
"""

from __future__ import annotations

import argparse

from common import add_smoke, engine_rounds, engine_times, mb, preamble, table
from ddp_vs_torch import overrides as ddp_overrides
from shardwise.launchers.harness import run_world

NPROC = 2
DDP = "support.peers:ddp_peer"
# DDP refuses its bf16 hook without CUDA/NCCL ("BF16 all reduce communication hook required
# CUDA 11+ and NCCL 2.10+"): on CPU the 16-bit row is fp16 (the same bytes)
KINDS = ("none", "fp16", "powersgd")


def base(steps: int) -> list[str]:
    """ddp_vs_torch.py's decoder and recipe (its first size), rank-4 PowerSGD."""
    return [*ddp_overrides("L4 d256", steps), "--parallel.powersgd_rank=4"]


def late_loss(per_rank: list[dict], k: int = 10) -> float:
    losses = per_rank[0]["losses"]
    return sum(losses[-k:]) / len(losses[-k:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per case (5 warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="repetitions, order alternating")
    add_smoke(parser)
    args = parser.parse_args()
    steps, rounds = (3, 1) if args.smoke else (args.steps, args.rounds)
    engines = []
    for kind in KINDS:
        flag = [f"--parallel.grad_compression={kind}"]
        engines += [(f"shardwise {kind}", flag, None), (f"DDP {kind}", flag, DDP)]
    cases, keys = engine_rounds(engines, base(steps), rounds)
    by_key = dict(zip(keys, run_world(NPROC, cases), strict=True))
    for key, per_rank in by_key.items():
        assert all("error" not in r for r in per_rank), (key, per_rank[0].get("error"))
    names = [name for name, _, _ in engines]
    times = engine_times(by_key, names, rounds)
    preamble()
    rows = []
    for kind in KINDS:
        ours, theirs = by_key[f"shardwise {kind}", 0], by_key[f"DDP {kind}", 0]
        rows.append(
            [
                kind,
                f"{times[f'shardwise {kind}'] * 1e3:.1f}",
                f"{times[f'DDP {kind}'] * 1e3:.1f}",
                f"{times[f'shardwise {kind}'] / times[f'DDP {kind}']:.2f}",
                f"{times[f'shardwise {kind}'] / times['shardwise none']:.2f}",
                f"{times[f'DDP {kind}'] / times['DDP none']:.2f}",
                mb(ours[0]["records"][-1]["comm_bytes"]["dp"]),
                f"{late_loss(ours):.4f}",
                f"{late_loss(theirs):.4f}",
            ]
        )
    print(
        table(
            [
                "compression",
                "ours ms",
                "DDP ms",
                "ours/DDP",
                "ours vs none",
                "DDP vs none",
                "our dp MB/step",
                "our loss (last 10)",
                "DDP loss (last 10)",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
