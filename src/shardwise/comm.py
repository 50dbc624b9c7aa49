"""The only place collectives are called.

Each call is counted in ring-equivalent bytes sent per rank, per mesh dimension (DESIGN.md):
all-reduce of S bytes over n ranks = 2(n-1)/n·S; reduce-scatter / all-gather of a full tensor
of S bytes = (n-1)/n·S; point-to-point = S. Each call is also appended to a per-rank trace
(op, mesh dim, shape, dtype, call site) so a hang can be localised to the first collective on
which ranks disagree. At degree 1 every collective is a no-op and costs nothing.
"""

from __future__ import annotations

import sys
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.topology import Topology

# torch 2.13 renamed the flat collectives; keep working on the older releases we support.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True)
class TraceEntry:
    seq: int
    op: str
    dim: str
    shape: tuple[int, ...]
    dtype: str
    site: str


class _Done:
    """Stands in for a finished async handle at degree 1."""

    def wait(self) -> bool:
        return True


class Comm:
    """Collectives over the mesh dimensions of one Topology, with byte accounting and a trace.

    `control=True` marks bookkeeping traffic (loss and memory reporting): traced, but counted
    apart from the step's training traffic so the per-step numbers match the formulas."""

    def __init__(self, topology: Topology, trace_len: int = 4096) -> None:
        self.topo = topology
        self.step_bytes: dict[str, float] = defaultdict(float)
        self.control_bytes: float = 0.0
        self.trace: deque[TraceEntry] = deque(maxlen=trace_len)
        self.seq = 0

    # -- accounting -------------------------------------------------------------------------
    def _record(self, op: str, dim: str, t: torch.Tensor, factor: float, control: bool) -> None:
        frame = sys._getframe(2)
        site = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        self.seq += 1
        self.trace.append(TraceEntry(self.seq, op, dim, tuple(t.shape), str(t.dtype), site))
        sent = factor * t.numel() * t.element_size()
        if control:
            self.control_bytes += sent
        else:
            self.step_bytes[dim] += sent

    def take_step_bytes(self) -> dict[str, float]:
        """Bytes per dimension since the last call, then reset."""
        out = {d: self.step_bytes.get(d, 0.0) for d in ("dp", "tp", "pp")}
        self.step_bytes.clear()
        return out

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(
        self,
        t: torch.Tensor,
        dim: str,
        op: str = "sum",
        async_op: bool = False,
        control: bool = False,
    ):
        """In-place all-reduce of `t` over mesh dimension `dim`."""
        n = self.topo.size(dim)
        if n == 1:
            return _Done() if async_op else None
        self._record("all_reduce", dim, t, 2 * (n - 1) / n, control)
        return dist.all_reduce(t, op=_OPS[op], group=self.topo.group(dim), async_op=async_op)

    def reduce_scatter(
        self, out: torch.Tensor, full: torch.Tensor, dim: str, async_op: bool = False
    ):
        """Sum `full` over `dim` and keep this rank's 1/n slice in `out`."""
        n = self.topo.size(dim)
        if n == 1:
            out.copy_(full)
            return _Done() if async_op else None
        self._record("reduce_scatter", dim, full, (n - 1) / n, False)
        return _reduce_scatter(out, full, group=self.topo.group(dim), async_op=async_op)

    def all_gather(self, full: torch.Tensor, part: torch.Tensor, dim: str, async_op: bool = False):
        """Concatenate every rank's `part` along dim 0 into `full`."""
        n = self.topo.size(dim)
        if n == 1:
            full.copy_(part)
            return _Done() if async_op else None
        self._record("all_gather", dim, full, (n - 1) / n, False)
        return _all_gather(full, part, group=self.topo.group(dim), async_op=async_op)

    def broadcast(self, t: torch.Tensor, dim: str, src_coord: int = 0, control: bool = False):
        """Broadcast from the rank at index `src_coord` along `dim`."""
        n = self.topo.size(dim)
        if n == 1:
            return None
        self._record("broadcast", dim, t, (n - 1) / n, control)
        group = self.topo.group(dim)
        return dist.broadcast(t, group=group, group_src=src_coord)

    def all_reduce_world(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Control-plane all-reduce over every rank (metrics, checks); not training traffic."""
        if self.topo.world > 1:
            self._record("all_reduce", "world", t, 0.0, True)
            dist.all_reduce(t, op=_OPS[op])
        return t
