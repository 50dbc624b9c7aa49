"""Activation recomputation: saved-activation bytes and step time for none / selective / full.

Measured by the engine's saved-tensor accounting on the tiny decoder (one process), with the
losses compared step by step: recomputation must not change them.

    .venv/bin/python benchmarks/recompute.py [--steps 8] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from common import add_smoke
from shardwise.launchers.harness import run_world


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.seq_len, args.batch = 3, 32, 2
    print("command:", " ".join([".venv/bin/python", *sys.argv]))
    base = [
        f"--train.steps={args.steps}",
        f"--data.seq_len={args.seq_len}",
        f"--train.global_batch={args.batch}",
        "--train.eval_batches=0",
    ]
    modes = ["none", "selective", "full"]
    cases = [
        {"overrides": [*base, f"--memory.recompute={m}", f"--model.n_layers={n}"]}
        for m in modes
        for n in (2, 4)
    ]
    results = {
        (c["overrides"][-2], c["overrides"][-1]): r[0]
        for c, r in zip(cases, run_world(1, cases), strict=True)
    }

    def get(mode: str, layers: int) -> dict:
        return results[(f"--memory.recompute={mode}", f"--model.n_layers={layers}")]

    def act(res: dict) -> int:
        return res["records"][0]["mem_bytes"]["activations"]

    def median_time(res: dict) -> float:
        return statistics.median(r["step_time_s"] for r in res["records"][2:])

    # Per layer: the difference between 4 and 2 blocks, halved (removes embedding/head/loss).
    ref = get("none", 4)
    ref_layer = (act(ref) - act(get("none", 2))) / 2
    sbh = args.batch * args.seq_len * 128  # tiny: hidden 128, fp32
    print(f"\nper layer, b={args.batch} s={args.seq_len} h=128 fp32 (sbh*4 = {4 * sbh:,} B)")
    print(
        f"{'recompute':<10} {'whole model':>12} {'vs none':>8} {'per layer':>12} {'vs none':>8} "
        f"{'/ (4sbh)':>9} {'step time':>10} {'vs none':>8} {'max |dloss|':>12}"
    )
    for mode in modes:
        full, small = get(mode, 4), get(mode, 2)
        layer = (act(full) - act(small)) / 2
        diff = max(abs(a - b) for a, b in zip(full["losses"], ref["losses"], strict=True))
        print(
            f"{mode:<10} {act(full) / 1e6:>9.2f} MB {act(full) / act(ref):>8.3f} "
            f"{layer / 1e6:>9.3f} MB {layer / ref_layer:>8.3f} {layer / (4 * sbh):>9.2f} "
            f"{1000 * median_time(full):>7.0f} ms {median_time(full) / median_time(ref):>8.2f} "
            f"{diff:>12.2e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
