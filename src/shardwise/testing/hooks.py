"""Hooks the tests apply to a built run before `fit()` (fault injection)."""

from __future__ import annotations

import torch


def inject_inf_on_rank1_step3(run) -> None:
    """Make one gradient infinite on dp rank 1 during the 3rd optimizer step's backward."""
    if run.topo.rank != 1:
        return
    calls = {"n": 0}
    first = next(p for p in run.model.parameters() if p.requires_grad)

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return torch.full_like(grad, float("inf")) if calls["n"] == 3 else grad

    first.register_hook(poison)


def return_buffers(run) -> None:
    """Ask the harness to return the model's floating buffers (BatchNorm statistics)."""
    run.return_buffers = True


def skip_mlp_on_even_steps(run) -> None:
    """Leave block 1's MLP out of the graph on every other forward: its parameters get no
    gradient on those steps (an unused-parameter case that must neither hang nor drift)."""
    block = run.model.blocks[1]
    forward = block.mlp.forward
    calls = {"n": 0}

    def maybe_skip(x):
        calls["n"] += 1
        return torch.zeros_like(x) if calls["n"] % 2 == 0 else forward(x)

    block.mlp.forward = maybe_skip
