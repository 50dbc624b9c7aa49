"""Steps skipped for non-finite values: which tensors, on which rank, and when to give up.

A step is skipped on every rank alike when the loss (reduced over all ranks before the step)
or the global gradient norm is not finite; both are the same number on every rank, so the
decision is too. On a skipped step the ranks pool, in one small all-reduce, which parameters
have a non-finite gradient (each rank sees its own ZeRO slices) and which ranks computed a
non-finite loss, so the log and the final diagnosis name them. After
`train.max_skipped_steps` such steps in a row the job stops with that diagnosis. fp16
overflows while the loss scale can still shrink are dynamic loss scaling at work, not a
fault, and do not count.
"""

from __future__ import annotations

import torch

from shardwise.errors import ShardwiseError


class NonFiniteError(ShardwiseError):
    """Training produced non-finite values for `train.max_skipped_steps` steps in a row."""


def _names(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def describe(d: dict) -> str:
    """One line for a skipped step's `nonfinite` record."""
    parts = []
    if d["loss_ranks"]:
        parts.append(f"non-finite loss on rank(s) {d['loss_ranks']}")
    if d["grads"]:
        parts.append(f"non-finite gradient in {len(d['grads'])} tensor(s): {_names(d['grads'])}")
    return "; ".join(parts) or "non-finite gradient norm"


class NonFiniteGuard:
    """Diagnoses skipped steps and stops the job after too many in a row."""

    def __init__(self, run) -> None:
        self.comm, self.rank = run.comm, run.topo.rank
        self.limit = run.cfg.train.max_skipped_steps
        self.scaler = run.optimizer.scaler
        self.names = [n for n, p in run.model.named_parameters() if p.requires_grad]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.streak: list[tuple[int, dict]] = []

    def diagnose(self, local_loss: torch.Tensor, nonfinite: tuple[str, ...]) -> dict:
        """Pool every rank's view of a skipped step (a collective: every rank calls it on the
        same steps, since the skip decision is the same everywhere)."""
        n, world = len(self.names), self.comm.topo.world
        flags = torch.zeros(n + world, dtype=torch.float32, device=local_loss.device)
        for name in nonfinite:
            flags[self.index[name]] = 1.0
        flags[n + self.rank] = float(not bool(torch.isfinite(local_loss)))
        self.comm.all_reduce_world(flags, "max")
        hit = flags.tolist()
        return {
            "loss_ranks": [r for r in range(world) if hit[n + r]],
            "grads": [name for name, h in zip(self.names, hit, strict=False) if h],
        }

    def check(self, step: int, record: dict, scale_before: float) -> None:
        """Count a skipped step (unless it is fp16 loss scaling at work) and stop the job with
        the diagnosis after `train.max_skipped_steps` in a row."""
        d = record.get("nonfinite")
        overflow = self.scaler.enabled and scale_before > 1.0 and d and not d["loss_ranks"]
        if not record["skipped"] or overflow:
            self.streak.clear()
            return
        self.streak.append((step, d))
        if not self.limit or len(self.streak) < self.limit:
            return
        (first, d0), (last, d1) = self.streak[0], self.streak[-1]
        raise NonFiniteError(
            f"train.max_skipped_steps={self.limit}: steps {first}-{last} were all skipped "
            f"for non-finite values. Step {first}: {describe(d0)}. Step {last}: {describe(d1)}."
            " Fix: lower train.lr or set optim.grad_clip, check the data of these steps, use "
            "precision.compute=bf16 instead of fp16; or raise train.max_skipped_steps."
        )
