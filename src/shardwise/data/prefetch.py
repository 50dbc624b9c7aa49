"""Micro-batches fetched ahead in background threads (`data.prefetch`), so a slow source
(disk, network, a user's `get_batch`) loads the next batches while the current one computes.

The batches and their order are exactly those of the plain loop: the indices are known ahead
(a function of seed and step), only *when* they are loaded changes. The dataset's `get_batch`
then runs in a worker thread: reading files and sleeping release the GIL and overlap fully;
Python-heavy work (tokenising on the fly) competes with the training thread instead.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


def _key(idx: torch.Tensor) -> tuple[int, ...]:
    return tuple(idx.tolist())


class Fetch:
    """`fetch(idx, upcoming)`: the batch of `idx`, keeping up to `depth` of the `upcoming`
    index sets (in order) loading in threads; depth 0 loads each when asked."""

    def __init__(self, data, depth: int) -> None:
        self.data, self.depth = data, depth
        self.pool = None
        if depth:
            self.pool = ThreadPoolExecutor(depth, thread_name_prefix="shardwise-prefetch")
        self.pending: dict[tuple[int, ...], Future] = {}

    def __call__(self, idx: torch.Tensor, upcoming: list[torch.Tensor]) -> tuple:
        if self.pool is None:
            return self.data.get_batch(idx)
        future = self.pending.pop(_key(idx), None)
        for nxt in upcoming:
            if len(self.pending) >= self.depth:
                break
            if (k := _key(nxt)) not in self.pending:
                self.pending[k] = self.pool.submit(self.data.get_batch, nxt)
        return future.result() if future is not None else self.data.get_batch(idx)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
