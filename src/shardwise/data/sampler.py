"""Global, layout-invariant data order.

Which sample sits at global position p is a function of (seed, p) only: p belongs to epoch
p // N and takes slot p % N of that epoch's permutation, which is a `torch.randperm` seeded
from (seed, epoch). So every layout (any data-parallel degree, any micro-batch size) sees the
same global batch at every step, and resuming from step k needs no sampler state.
"""

from __future__ import annotations

import hashlib

import torch


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch), stable across runs (unlike `hash()`)."""
    digest = hashlib.blake2b(f"shardwise-data:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class GlobalSampler:
    """Sample indices of every global batch, as a pure function of (seed, step)."""

    def __init__(self, num_samples: int, global_batch: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1")
        if global_batch < 1:
            raise ValueError(f"global_batch={global_batch} must be >= 1")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        # The current epoch's permutation (and the previous one, for batches that straddle
        # an epoch boundary): regenerating it every step would cost O(N) per step.
        self._perms: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of one epoch: int64 [num_samples]."""
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            perm = torch.randperm(self.num_samples, generator=gen)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = perm
        return perm

    def global_indices(self, step: int) -> torch.Tensor:
        """Sample indices of global batch `step`: int64 [global_batch]."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        positions = step * self.global_batch + torch.arange(self.global_batch)
        epochs = positions // self.num_samples
        slots = positions % self.num_samples
        out = torch.empty(self.global_batch, dtype=torch.int64)
        for epoch in torch.unique(epochs).tolist():
            here = epochs == epoch
            out[here] = self.permutation(epoch)[slots[here]]
        return out

    def epoch(self, step: int) -> float:
        """Fractional epochs completed after `step` steps (for logging)."""
        return step * self.global_batch / self.num_samples


def split_for_rank(
    global_indices: torch.Tensor, dp_rank: int, dp_size: int, micro_batch: int
) -> list[torch.Tensor]:
    """Rank `dp_rank`'s micro-batches: its contiguous 1/dp_size slice of the global batch."""
    total = len(global_indices)
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if total % dp_size:
        raise ValueError(
            f"global batch {total} is not divisible by the data-parallel degree {dp_size}; "
            f"use a global batch that is a multiple of {dp_size}"
        )
    per_rank = total // dp_size
    if micro_batch < 1 or per_rank % micro_batch:
        raise ValueError(
            f"per-rank batch {per_rank} (global batch {total} / dp {dp_size}) is not divisible "
            f"by micro_batch {micro_batch}; use a micro batch that divides {per_rank}"
        )
    mine = global_indices[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return list(mine.split(micro_batch))
