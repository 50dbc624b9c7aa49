"""What every parity test shares: the small configuration and the two distances."""

from __future__ import annotations

import math

import torch

# A small decoder and short sequences keep 20 steps per case fast on a CPU. The learning rate is
# a fine-tuning-sized 1e-3: Adam divides each coordinate by its own RMS, so a gradient entry that
# is zero up to fp32 rounding (large contributions cancelling, summed in a different order in
# another layout) moves by up to ±lr per step. The differences in the final parameters scale with
# lr (measured: 2.3e-5 at lr 3e-3 on 18 of 524k embedding entries, 4e-6 at 1e-3), the losses not.
# Adam's eps is 1e-6 for the same reason: with the default 1e-8 below that rounding noise
# (~1e-9), such an entry's update is lr·g/(|g| + eps), a sizeable fraction of lr whose size the
# noise decides; on an AVX-512 host one embedding entry of a pp2 run ended 1.06e-4 from the
# single process's (relative L2 of the tensor 2.1e-5) while every other entry agreed to 5e-6.
# With 1e-6 that tensor agrees to 3.1e-7 (max entry 8.9e-7); real gradients here are
# 1e-4..1e-1, their √v far above either eps.
# The 512-token vocabulary (its own BPE, trained once and cached) keeps the output head from
# dominating a step: with the preset's 4096 it took a third of each case's time.
VOCAB = 512
SMALL = [
    "--model.n_layers=2",
    f"--model.vocab_size={VOCAB}",
    "--data.seq_len=32",
    "--train.global_batch=8",
    "--train.steps=20",
    "--train.eval_every=0",
    "--train.eval_batches=0",
    "--optim.warmup_steps=5",
    "--train.lr=1e-3",
    "--optim.eps=1e-6",
]


def case(*overrides: str, **extra) -> dict:
    """A harness case: SMALL plus `overrides` (later ones win), plus hook/peer entries."""
    return {"overrides": [*SMALL, *overrides], **extra}


def max_rel(a: list[float], b: list[float]) -> float:
    """Largest relative difference between two loss curves (b is the reference); NaN if any
    is NaN (`max` would pass over one that is not first)."""
    diffs = [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]
    return math.nan if any(map(math.isnan, diffs)) else max(diffs)


def max_param_diff(pa: dict[str, torch.Tensor], pb: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over all parameters (same names required, at least one)."""
    assert pa.keys() == pb.keys(), sorted(set(pa) ^ set(pb))
    assert pa, "no parameters to compare"
    return worst_tensor(pa, pb)[0]


def worst_tensor(got: dict, ref: dict, rel_l2: bool = False) -> tuple[float, str]:
    """The largest difference of `got`'s tensors from `ref`'s and that tensor's name: the
    largest absolute entry, or (rel_l2) the difference's L2 norm over the reference tensor's."""
    worst, where = 0.0, ""
    for name, value in got.items():
        diff = value - ref[name]
        if rel_l2:
            d = (diff.norm() / ref[name].norm().clamp_min(1e-30)).item()
        else:
            d = diff.abs().max().item()
        if math.isnan(d):  # the worst there is (and `<` would pass over it)
            return d, name
        if d > worst or not where:
            worst, where = d, name
    return worst, where


def assert_reproduces(
    name: str,
    ranks: list[dict],
    ref: dict,
    *,
    tol: float = 1e-5,
    grad_norms: bool = True,
    params: bool = True,
    sharded: bool = False,
    rel_l2: bool = False,
) -> None:
    """Assert every rank of case `name` reproduces `ref`: losses and gradient norms within `tol`
    relative, parameters within `tol`; messages name the case, rank, quantity and worst value.

    `sharded`: each rank holds part of the parameters (a stage's, tp gathered), together all
    of them; otherwise each rank holds all. `rel_l2`: a tensor's difference relative to its L2
    norm, not the largest absolute entry."""
    seen: set[str] = set()
    for i, r in enumerate(ranks):
        at = f"{name} rank {i}"
        steps = (len(r["losses"]), len(ref["losses"]))
        assert steps[0] == steps[1], f"{at}: {steps[0]} losses, the reference {steps[1]}"
        worst = max_rel(r["losses"], ref["losses"])
        assert worst <= tol, f"{at}: losses differ by {worst:.3g} relative (> {tol})"
        if grad_norms:
            got = [x["grad_norm"] for x in r["records"]]
            worst = max_rel(got, [x["grad_norm"] for x in ref["records"]])
            assert worst <= tol, f"{at}: grad norms differ by {worst:.3g} relative (> {tol})"
        if not params:
            continue
        mine = r["params"]
        odd = sorted(set(mine) - set(ref["params"]) if sharded else set(mine) ^ set(ref["params"]))
        assert not odd, f"{at}: parameter names differ from the reference's: {odd}"
        worst, where = worst_tensor(mine, ref["params"], rel_l2)
        kind = "relative L2" if rel_l2 else "absolute"
        assert worst <= tol, f"{at}: parameter {where} differs by {worst:.3g} {kind} (> {tol})"
        seen |= set(mine)
    if params and sharded:
        missing = sorted(set(ref["params"]) - seen)
        assert not missing, f"{name}: no rank holds parameters {missing}"
