"""Zero bubble's backward split (I then W) against one backward, by chunk depth, side by side
with PyTorch's split (`torch.distributed.pipelining._backward`, what its zero-bubble
schedules run).

What it measures, in one process on one core: a chunk of n decoder blocks (dim 256, FFN 944,
4 heads, 2 x 128 tokens), forward then backward from a random output gradient, timed from the
end of the forward:
* `B`: one ordinary backward;
* `shardwise`: I + W of `parallel.backward_split`, the forward run under `deferring()` as the
  pipeline runs it (linear layers and norms keep their weight gradients for W);
* `graph walk`: the same split for weights of ops that deferred_grads does not know (every
  weight here, the forward run plainly): W restarts autograd at each weight's node (how
  shardwise split the backward before 2026-11-22);
* `torch`: `stage_backward_input` + `stage_backward_weight`.
Cases run in rotating order, `--rounds` times each; medians. Every split must give the
gradients of one backward (relative L2 <= 1e-6, same fp32 ops). A split's price is
(I + W) / B - 1: what zero bubble must win back from the bubble before it pays (1F1B's bubble
at p = 2, m = 8 is 11%). Verdict: the gradients, and shardwise's split no slower than torch's
at every depth (target ratio <= 1.0).

    .venv/bin/python benchmarks/zb_split.py [--depths 4 8 16] [--rounds 10]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

from common import add_smoke, command_line, commit, load, median, table
from shardwise.distributed.device import keep_freed_memory
from shardwise.models import ModelSpec, build_model, init_weights
from shardwise.parallel.backward_split import backward_input, backward_weight
from shardwise.parallel.deferred_grads import deferring

DIM, FFN, SEQ, BATCH = 256, 944, 128, 2
SIDES = ("B", "shardwise", "graph walk", "torch")


def _chunk(depth: int):
    spec = ModelSpec("decoder", depth, DIM, 4, 4, FFN, 512)
    model = build_model(spec)
    init_weights(model, 0)
    return list(model.blocks), [p for b in model.blocks for p in b.parameters()]


def _run(side: str, blocks, weights, x0, grad) -> tuple[float, list[torch.Tensor]]:
    """One forward and the side's backward: (backward seconds, weight and input gradients)."""
    for w in weights:
        w.grad = None
    x = x0.clone().requires_grad_(True)
    with deferring() if side == "shardwise" else contextlib.nullcontext():
        h = x
        for block in blocks:
            h = block(h)
    t0 = time.perf_counter()
    if side == "B":
        torch.autograd.backward(h, grad)
    elif side == "torch":
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )

        _, groups = stage_backward_input([h], [grad], [x], iter(weights))
        stage_backward_weight(iter(weights), groups)
    else:
        backward_weight(backward_input(h, grad, x, weights))
    elapsed = time.perf_counter() - t0
    return elapsed, [w.grad.clone() for w in weights] + [x.grad.clone()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--rounds", type=int, default=10)
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.depths, args.rounds = [2], 3
    torch.set_num_threads(1)
    keep_freed_memory()
    print(f"shardwise commit {commit()}, torch {torch.__version__}")
    print(f"$ {command_line()}")
    print(f"load average at the start: {load()}")
    rows, ok = [], True
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(BATCH, SEQ, DIM, generator=gen)
    grad = torch.randn(BATCH, SEQ, DIM, generator=gen)
    for depth in args.depths:
        blocks, weights = _chunk(depth)
        _, ref = _run("B", blocks, weights, x0, grad)  # also warms up
        for side in SIDES[1:]:
            _, grads = _run(side, blocks, weights, x0, grad)
            err = max(float((a - b).norm() / b.norm()) for a, b in zip(grads, ref, strict=True))
            if err > 1e-6:
                print(f"{depth} blocks: {side} gradients off by {err:.2e} (relative L2)")
                ok = False
        times: dict[str, list[float]] = {s: [] for s in SIDES}
        for r in range(args.rounds):
            for side in SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]:
                times[side].append(_run(side, blocks, weights, x0, grad)[0])
        med = {s: median(times[s]) for s in SIDES}
        price = {s: med[s] / med["B"] - 1 for s in SIDES[1:]}
        good = med["shardwise"] <= med["torch"]
        ok &= good
        rows.append(
            [
                depth,
                *(f"{1000 * med[s]:.1f}" for s in SIDES),
                *(f"{100 * price[s]:+.0f}%" for s in SIDES[1:]),
                f"{med['shardwise'] / med['torch']:.3f}",
                "ok" if good else "NO",
            ]
        )
    header = ["blocks", *(f"{s} ms" for s in SIDES), *(f"{s} price" for s in SIDES[1:])]
    print(table([*header, "shardwise/torch", "verdict"], rows))
    print(f"load average at the end: {load()}")
    print("OK" if ok else "FAILED: a split is off one backward's gradients, or slower than torch's")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
