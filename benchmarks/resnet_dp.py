"""docs/design.md scenario 1: a ResNet-18 that trains on one process, scaled to 2 data-parallel
ranks, in fp32 and in bf16 (fp32 master weights and fp32 gradient reduction).

What it measures, for the 4 runs (1 process / 2 ranks x fp32 / bf16) with the same global
batch, steps, learning-rate schedule and seed: the median step time after warm-up, the
speed-up of 2 ranks over 1 process at the same precision, the peak per-rank memory by
category (counted by the engine from its own tensors, max over ranks and steps), the final
held-out accuracy and the final train/held-out loss, and how far the 2-rank loss curve is from
the 1-process one. Why: scenario 1 promises that data parallelism and mixed precision cut
step time and memory without changing what the model learns; this is the check, and it fails
(exit status 1) if any run ends below 90% held-out accuracy.

Every rank runs one intra-op thread (the harness sets it), so "1 process" is one core and
"2 ranks" two cores. The model is the CIFAR-stem ResNet-18 (11.2M parameters) on
scikit-learn's digits resized to 16x16 (--quick: the native 8x8): 1,438 training and 359
held-out images. Evaluation runs 360/global_batch global batches: all 359 held-out images
once, plus 1 repeated (359 is prime, so no even batch tiles it exactly).
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import (
    WARMUP_STEPS,
    add_smoke,
    check,
    command_line,
    commit,
    load,
    mb,
    median,
    steady,
    table,
)
from shardwise.launchers.harness import run_world

GLOBAL_BATCH = 72  # divides 360, so 5 eval batches cover the held-out split
HELD_OUT_SLOTS = 360
MIN_ACCURACY = 0.90
MEM_KEYS = ("params", "grads", "master", "optimizer", "buffers", "activations", "total")


def overrides(steps: int, image_size: int, precision: str) -> list[str]:
    return [
        "--model.name=resnet18",
        "--data.dataset=digits",
        f"--data.image_size={image_size}",
        f"--train.global_batch={GLOBAL_BATCH}",
        f"--train.steps={steps}",
        "--train.lr=3e-3",
        "--train.seed=0",
        "--optim.warmup_steps=5",
        "--train.eval_every=0",  # evaluate once, at the end
        f"--train.eval_batches={HELD_OUT_SLOTS // GLOBAL_BATCH}",
        f"--precision.compute={precision}",
    ]


def summarise(name: str, records: list[dict]) -> dict:
    last = records[-1]
    peak = {k: max(r["mem_bytes"][k] for r in records) for k in MEM_KEYS}
    return {
        "name": name,
        "step": median(steady([r["step_time_s"] for r in records])),
        "peak": peak,
        "acc": last["eval_accuracy"],
        "loss": last["loss"],
        "eval_loss": last["eval_loss"],
        "losses": [r["loss"] for r in records],
        "dp_bytes": median([r["comm_bytes"]["dp"] for r in records]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=0, help="optimizer steps (default 60; 40 --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="native 8x8 images, 40 steps")
    add_smoke(parser)
    args = parser.parse_args()
    args.quick |= args.smoke
    args.steps = 2 if args.smoke else args.steps
    image_size = 8 if args.quick else 16
    steps = args.steps or (40 if args.quick else 60)
    print(f"$ {command_line()}")
    print(f"shardwise commit {commit()}, torch {torch.__version__}")
    precisions = ("fp32", "bf16")
    print("cases:", " ".join(overrides(steps, image_size, "<fp32|bf16>")))
    print(f"timing: median of steps {WARMUP_STEPS + 1}..{steps}; memory: peak over steps")
    print(f"load average at the start: {load()} (2 cores, shared)\n")

    runs = {}
    for nproc in (1, 2):
        results = run_world(
            nproc, [{"overrides": overrides(steps, image_size, p)} for p in precisions]
        )
        check(results)
        for precision, per_rank in zip(precisions, results, strict=True):
            name = f"{nproc} proc {precision}" if nproc == 1 else f"{nproc} ranks {precision}"
            runs[nproc, precision] = summarise(name, per_rank[0]["records"])

    header = ["config", "median step s", "speed-up", *(f"{k} MB" for k in MEM_KEYS)]
    header += ["held-out acc", "train loss", "held-out loss", "dp MB/step"]
    rows = []
    for (_, precision), s in runs.items():
        speedup = runs[1, precision]["step"] / s["step"]
        rows.append(
            [
                s["name"],
                f"{s['step']:.3f}",
                f"{speedup:.2f}x",
                *(mb(s["peak"][k]) for k in MEM_KEYS),
                f"{100 * s['acc']:.1f}%",
                f"{s['loss']:.4f}",
                f"{s['eval_loss']:.4f}",
                mb(s["dp_bytes"]),
            ]
        )
    print(table(header, rows))

    print(
        "\nloss curve, 2 ranks vs 1 process (model.sync_batchnorm: BatchNorm normalises over "
        "both ranks' halves, as the one process over its whole batch):"
    )
    for precision in precisions:
        a, b = runs[1, precision]["losses"], runs[2, precision]["losses"]
        diff = [abs(x - y) for x, y in zip(a, b, strict=True)]
        worst = max(range(len(diff)), key=diff.__getitem__)
        at = f"{diff[worst]:.4f} at step {worst + 1}"
        print(f"  {precision}: max abs dloss {at}, last {diff[-1]:.4f}")

    print(f"\nload average at the end: {load()}")
    low = [s["name"] for s in runs.values() if s["acc"] < MIN_ACCURACY]
    if low and not args.smoke:
        print(f"\nFAIL: held-out accuracy below {MIN_ACCURACY:.0%}: {', '.join(low)}")
        return 1
    print(f"\nOK: every run reaches >= {MIN_ACCURACY:.0%} held-out accuracy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
