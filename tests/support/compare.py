"""What every parity test shares: the small configuration and the two distances."""

from __future__ import annotations

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
    """Largest relative difference between two loss curves (b is the reference)."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def max_param_diff(pa: dict[str, torch.Tensor], pb: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over all parameters (same names required)."""
    assert pa.keys() == pb.keys(), sorted(set(pa) ^ set(pb))
    return max((pa[k] - pb[k]).abs().max().item() for k in pa)
