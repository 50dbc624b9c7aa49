"""Our optimizer step against torch.optim.AdamW (fused and foreach), side by side in one process.

The same parameters (the 125m preset's shapes, ~125M parameters, held in bf16 as precision.compute
bf16 holds them) and the same bf16 gradients for every engine. Each engine does the whole
mixed-precision step: up-cast the gradients beside fp32 masters, measure the global norm and clip
(to 1.0: every step clips here), AdamW on the masters, copy them back into the bf16 parameters.
"ours" is optim.MixedPrecisionAdamW (fp64 norm, torch's fused AdamW); the peers write the same
recipe with torch alone: clip_grad_norm_ (foreach) and torch.optim.AdamW(fused=True) or
(foreach=True). "torch fused, AdamW step only" times the fused AdamW kernel inside the torch
fused recipe: the floor under any recipe. The engines are built side by side (~8 GB at 125m)
and stepped in turn, the order flipping every step; per engine the median step after the
warm-up. One intra-op thread, as a rank runs.

    .venv/bin/python benchmarks/optimizer_step.py [--model 125m] [--rounds 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from common import add_smoke, median, preamble, table
from shardwise.config import load_config
from shardwise.models import build_on_meta
from shardwise.models.presets import preset
from shardwise.optim import MixedPrecisionAdamW, Target

WARMUP = 2  # the first steps allocate the moments and fault in fresh pages


def _params(model: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [p.shape for p in build_on_meta(preset(model)).parameters()]
    return [(torch.randn(s, generator=gen) * 0.02).bfloat16() for s in shapes]


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(p.shape, generator=gen).bfloat16() for p in params]


def _ours(params, grads, cfg):
    targets = [Target(p, (lambda g=g: g), p.ndim >= 2) for p, g in zip(params, grads, strict=True)]
    opt = MixedPrecisionAdamW(targets, cfg)
    loss = torch.tensor(1.0)

    def step() -> float:
        opt.step(loss)
        return 0.0

    return step


def _torch(params, grads, cfg, **impl):
    """The recipe with torch alone; each step returns the seconds of AdamW's own step."""
    masters = [p.float() for p in params]
    o = cfg.optim
    groups = [
        {"params": [m for m in masters if m.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(o.beta1, o.beta2), eps=o.eps, **impl)

    def step() -> float:
        for m, g in zip(masters, grads, strict=True):
            m.grad = g.float()
        torch.nn.utils.clip_grad_norm_(masters, o.grad_clip, foreach=True)
        t0 = time.perf_counter()
        opt.step()
        inner = time.perf_counter() - t0
        torch._foreach_copy_(params, masters)
        for m in masters:
            m.grad = None
        return inner

    return step


ENGINES = {
    "ours (MixedPrecisionAdamW)": _ours,
    "torch fused": lambda p, g, c: _torch(p, g, c, fused=True),
    "torch foreach": lambda p, g, c: _torch(p, g, c, foreach=True),
}
STEP_ONLY = "torch fused, AdamW step only"  # inside "torch fused"'s steps


def _times(model: str, cfg, rounds: int, steps: int) -> dict[str, float]:
    """Per engine, the median step seconds over rounds x steps after WARMUP, the engines
    built side by side on their own copies of the same parameters and stepped in turn (each
    round in the other order), so the machine's load hits them alike."""
    params = _params(model)
    grads = _grads(params)
    steppers = {n: make([p.clone() for p in params], grads, cfg) for n, make in ENGINES.items()}
    del params
    gc.collect()
    names = list(steppers)
    times: dict[str, list[float]] = {n: [] for n in [*names, STEP_ONLY]}
    for r in range(rounds):
        for i in range(WARMUP + steps):
            for name in names if (r + i) % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                inner = steppers[name]()
                if i >= WARMUP:
                    times[name].append(time.perf_counter() - t0)
                    if name == "torch fused":
                        times[STEP_ONLY].append(inner)
    return {n: median(v) for n, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="125m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    add_smoke(ap)
    args = ap.parse_args()
    model, rounds, steps = args.model, args.rounds, args.steps
    if args.smoke:
        model, rounds, steps = "tiny", 1, 2
    torch.set_num_threads(1)
    preamble()
    cfg = load_config(None, ["--precision.compute=bf16", "--optim.grad_clip=1.0"])
    n = sum(p.numel() for p in build_on_meta(preset(model)).parameters())
    print(f"{model}: {n / 1e6:.1f}M parameters (bf16), fp32 masters; one thread")
    times = _times(model, cfg, rounds, steps)
    ours = times["ours (MixedPrecisionAdamW)"]
    rows = [
        [name, f"{t * 1000:.1f}", f"{t / ours:.3f}", f"{n * 1e-6 / t:.0f}"]
        for name, t in times.items()
    ]
    print(table(["engine", "step ms", "/ ours", "M params/s"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
