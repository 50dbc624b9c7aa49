"""Shared helpers of the benchmark scripts: the command line, medians, tables, a byte-counting
DDP peer. Imported as `common` (the scripts' own directory is on `sys.path`, also in the
spawned ranks, which inherit the parent's `sys.path`)."""

from __future__ import annotations

import os
import shlex
import statistics
import sys
from collections.abc import Sequence

import torch

WARMUP_STEPS = 5  # first steps pay allocator growth, lazy init and cold caches


def command_line() -> str:
    """The exact command that produced this output (environment that matters included)."""
    env = " ".join(
        f"{k}={shlex.quote(os.environ[k])}"
        for k in ("SHARDWISE_CACHE", "OMP_NUM_THREADS")
        if k in os.environ
    )
    argv = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    return f"{env} {argv}".strip()


def load() -> str:
    """The 1/5/15-minute load averages: how busy the shared machine was."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def steady(times: Sequence[float], warmup: int = WARMUP_STEPS) -> list[float]:
    """Step times after the warm-up steps (all of them if the run is too short)."""
    return list(times[warmup:]) or list(times)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (pastes into RESULTS.md unchanged)."""
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def check(results: list[list[dict]]) -> None:
    """Fail loudly when a case raised inside the spawned world."""
    for case in results:
        for rank, r in enumerate(case):
            if "error" in r:
                sys.exit(f"rank {rank} failed:\n{r['error']}")


def _counting_hook(state: dict, bucket):
    """All-reduce like DDP's default (average), counting ring-equivalent bytes sent."""
    n = torch.distributed.get_world_size()
    buf = bucket.buffer()
    state["bytes"] += 2 * (n - 1) / n * buf.numel() * buf.element_size()
    buf.div_(n)
    work = torch.distributed.all_reduce(buf, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def counting_ddp_peer(cfg) -> dict:
    """`shardwise.testing.peers.ddp_peer` with a comm hook that counts DDP's gradient bytes.

    Only for measuring bytes: a Python comm hook replaces DDP's C++ all-reduce, so step
    times of this peer are not the ones to compare (the timed peer runs without it)."""
    from shardwise.testing import peers

    state = {"bytes": 0.0}
    plain = peers.DistributedDataParallel

    class Counting(plain):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.register_comm_hook(state, _counting_hook)

    peers.DistributedDataParallel = Counting
    try:
        out = peers.ddp_peer(cfg)
    finally:
        peers.DistributedDataParallel = plain
    out["comm_bytes_per_step"] = state["bytes"] / cfg.train.steps
    return out
