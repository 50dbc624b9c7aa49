"""The only place collectives are called.

Each call is counted in ring-equivalent bytes sent per rank, per mesh dimension (docs/design.md):
all-reduce of S bytes over n ranks = 2(n-1)/n·S; reduce-scatter / all-gather of a full tensor
of S bytes = (n-1)/n·S; point-to-point = S (a receive is counted by its sender). The calls are
counted too (a send is one call; each pays a latency whatever its size), and the time this
rank spends blocked in them. Each call is also appended to a per-rank trace (op, mesh dim,
shape, dtype, call site, and its index among this rank's collectives on that dimension) so a
hang can be localised to the first collective on which ranks disagree; while a collective
blocks (a point-to-point wait included), `blocked` says which one and since when (read by
shardwise.distributed.watchdog). At degree 1 every collective is a no-op and costs nothing.
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.distributed.clock import clock
from shardwise.distributed.topology import Topology

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
    n: int = 0  # 1-based index among this rank's collectives on `dim` (groups compare by it)


class _Watched:
    """An async handle whose `wait()` is timed as blocking on its collective."""

    def __init__(self, work, entry: TraceEntry, comm: Comm) -> None:
        self.work, self.entry, self.comm = work, entry, comm
        clock().issued(entry.dim)

    def wait(self) -> bool:
        clk = clock()
        clk.waits(self.entry.dim)  # (in flight behind other work until here)
        try:
            return self.comm._blocking(self.entry, self.work.wait, waiting=True)
        finally:
            clk.waited(self.entry.dim)

    def is_completed(self) -> bool:
        return self.work.is_completed()


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
        # per mesh dimension since `start_step`: training bytes and calls, and the seconds this
        # rank spent blocked in any collective (launch or wait: the communication the step did
        # not hide, plus waiting for slower ranks)
        self.step_bytes: dict[str, float] = defaultdict(float)
        self.step_calls: dict[str, int] = defaultdict(int)
        self.step_wait: dict[str, float] = defaultdict(float)
        self.control_bytes: float = 0.0
        self.trace: deque[TraceEntry] = deque(maxlen=trace_len)
        self.seq = 0
        self.dim_seq: dict[str, int] = defaultdict(int)
        # (entry, time.monotonic() when the wait began) while this rank blocks in a collective
        self.blocked: tuple[TraceEntry, float] | None = None
        self.watchdog = None  # shardwise.distributed.watchdog.Watchdog when the job has > 1 rank
        # Code of wrappers that forward to these methods: the call site is their caller's.
        self.passthrough: set = set()

    # -- accounting -------------------------------------------------------------------------
    def _record(
        self,
        op: str,
        dim: str,
        t: torch.Tensor,
        factor: float,
        control: bool,
        sent: float | None = None,
    ) -> TraceEntry:
        frame = sys._getframe(2)
        while frame.f_code in self.passthrough and frame.f_back is not None:
            frame = frame.f_back
        site = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        self.seq += 1
        self.dim_seq[dim] += 1
        entry = TraceEntry(self.seq, op, dim, tuple(t.shape), str(t.dtype), site, self.dim_seq[dim])
        self.trace.append(entry)
        called = sent is not None or factor > 0  # a receive is its sender's call
        if sent is None:
            sent = factor * t.numel() * t.element_size()
        if control:
            self.control_bytes += sent
        else:
            self.step_bytes[dim] += sent
            self.step_calls[dim] += int(called)
        return entry

    def _blocking(self, entry: TraceEntry, call, waiting: bool = False):
        """Run `call` (a collective or a handle's wait) marked as blocking on `entry`. A
        failure (gloo's own timeout, a peer that went away) is handed to the watchdog first,
        so every rank's trace is collected before the job stops. `waiting`: an async call's
        wait (profiles match each call and each wait across ranks)."""
        t0 = time.monotonic()
        self.blocked = (entry, t0)
        clk = clock()
        try:
            with clk.comm(entry.dim):
                return call()
        except RuntimeError as exc:
            if self.watchdog is not None:
                self.watchdog.collective_failed(entry, exc)  # returns only if it cannot stop
            raise
        finally:
            self.blocked = None
            waited = time.monotonic() - t0
            self.step_wait[entry.dim] += waited
            if clk.calls is not None:
                clk.calls.append((entry.dim, entry.n, waiting, waited))

    def _issue(self, entry: TraceEntry, fn, *args, async_op: bool = False, **kwargs):
        """Call the collective `fn`; an async one's handle is timed when waited on."""
        work = self._blocking(entry, lambda: fn(*args, async_op=async_op, **kwargs))
        return _Watched(work, entry, self) if async_op else work

    def start_step(self) -> None:
        """Count from here: what ran before (loading a checkpoint, evaluation, a save) is not
        the step's communication."""
        for counts in (self.step_bytes, self.step_calls, self.step_wait):
            counts.clear()

    def take_step(self) -> dict[str, dict]:
        """The step's `comm_bytes`, `comm_calls` and `comm_wait_s` per dimension (the
        metrics.jsonl keys), then start counting again."""
        dims = ("dp", "tp", "pp") + (("cp",) if getattr(self.topo, "cp", 1) > 1 else ())
        dims += ("ep",) if getattr(self.topo, "ep", 1) > 1 else ()

        def of(counts: dict, d: str):
            # the expert gradients' reduction runs over part of a dp line (the ranks holding
            # the same experts, "edp"): it is data-parallel traffic, reported under dp
            return counts.get(d, 0) + (counts.get("edp", 0) if d == "dp" else 0)

        out = {
            "comm_bytes": {d: float(of(self.step_bytes, d)) for d in dims},
            "comm_calls": {d: of(self.step_calls, d) for d in dims},
            "comm_wait_s": {d: round(of(self.step_wait, d), 6) for d in dims},
        }
        self.start_step()
        return out

    def take_step_bytes(self) -> dict[str, float]:
        """Bytes per dimension since the last call (or `start_step`), then reset."""
        return self.take_step()["comm_bytes"]

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
        entry = self._record("all_reduce", dim, t, 2 * (n - 1) / n, control)
        group = self.topo.group(dim)
        return self._issue(entry, dist.all_reduce, t, op=_OPS[op], group=group, async_op=async_op)

    def reduce_scatter(
        self, out: torch.Tensor, full: torch.Tensor, dim: str, async_op: bool = False
    ):
        """Sum `full` over `dim` and keep this rank's 1/n slice in `out`."""
        n = self.topo.size(dim)
        if n == 1:
            out.copy_(full)
            return _Done() if async_op else None
        entry = self._record("reduce_scatter", dim, full, (n - 1) / n, False)
        group = self.topo.group(dim)
        return self._issue(entry, _reduce_scatter, out, full, group=group, async_op=async_op)

    def all_gather(self, full: torch.Tensor, part: torch.Tensor, dim: str, async_op: bool = False):
        """Concatenate every rank's `part` along dim 0 into `full`."""
        n = self.topo.size(dim)
        if n == 1:
            full.copy_(part)
            return _Done() if async_op else None
        entry = self._record("all_gather", dim, full, (n - 1) / n, False)
        group = self.topo.group(dim)
        return self._issue(entry, _all_gather, full, part, group=group, async_op=async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, dim: str, async_op: bool = False):
        """Split `inp` into n equal slices along dim 0, send slice j to the rank at index j
        along `dim`, and put the slice received from index i at slice i of `out`. Each rank
        keeps 1/n of its tensor, so it sends (n-1)/n of it."""
        n = self.topo.size(dim)
        if n == 1:
            out.copy_(inp)
            return _Done() if async_op else None
        entry = self._record("all_to_all", dim, inp, (n - 1) / n, False)
        group = self.topo.group(dim)
        return self._issue(entry, dist.all_to_all_single, out, inp, group=group, async_op=async_op)

    def all_to_all_v(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_rows: list[int],
        in_rows: list[int],
        dim: str,
    ) -> None:
        """Uneven all-to-all along dim 0: rows in_rows[j] of `inp` (in order) go to the rank
        at index j along `dim`, rows out_rows[i] of `out` come from index i. Counted as the
        bytes this rank sends to the others (what it keeps is not sent)."""
        n = self.topo.size(dim)
        if n == 1:
            out.copy_(inp)
            return
        row = math.prod(inp.shape[1:]) * inp.element_size()  # (a rank may send no rows)
        sent = (sum(in_rows) - in_rows[self.topo.coord(dim)]) * row  # exact, in bytes
        entry = self._record("all_to_all", dim, inp, 0.0, False, sent=sent)  # one call, always
        group = self.topo.group(dim)
        self._issue(
            entry,
            dist.all_to_all_single,
            out,
            inp,
            output_split_sizes=out_rows,
            input_split_sizes=in_rows,
            group=group,
        )

    def broadcast(self, t: torch.Tensor, dim: str, src_coord: int = 0, control: bool = False):
        """Broadcast from the rank at index `src_coord` along `dim`."""
        n = self.topo.size(dim)
        if n == 1:
            return None
        entry = self._record("broadcast", dim, t, (n - 1) / n, control)
        group = self.topo.group(dim)
        return self._issue(entry, dist.broadcast, t, group=group, group_src=src_coord)

    def all_reduce_in(
        self, t: torch.Tensor, group: dist.ProcessGroup, n: int, dim: str, control: bool = False
    ):
        """All-reduce (sum) over `group`, a subgroup of `n` ranks along mesh dimension `dim`
        (e.g. the first and last pipeline stage sharing a tied weight), counted under `dim`."""
        if n == 1:
            return None
        self._record("all_reduce", dim, t, 2 * (n - 1) / n, control)
        return dist.all_reduce(t, group=group)

    def p2p(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        dim: str = "pp",
    ) -> list:
        """Batched isend/irecv to and from global ranks along mesh dimension `dim`; returns one
        waitable per op (sends first). A send counts its bytes (p2p counts S); receives are
        counted by their senders."""
        group = self.topo.group(dim)
        ops, entries = [], []
        for t, peer in sends:
            entries.append(self._record("send", dim, t, 1.0, False))
            ops.append(dist.P2POp(dist.isend, t, peer, group))
        for t, peer in recvs:
            entries.append(self._record("recv", dim, t, 0.0, False))
            ops.append(dist.P2POp(dist.irecv, t, peer, group))
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # a coalesced backend (NCCL) returns one handle
            works = [works[-1]] * len(ops)
        # waits are timed (and shown to the watchdog) like every other collective's
        return [_Watched(w, e, self) for w, e in zip(works, entries, strict=True)]

    def all_reduce_world(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Control-plane all-reduce over every rank (metrics, checks); not training traffic."""
        if self.topo.world > 1:
            entry = self._record("all_reduce", "world", t, 0.0, True)
            self._issue(entry, dist.all_reduce, t, op=_OPS[op])
        return t


class ControlChannel:
    """Small Python objects exchanged over a dedicated gloo group of all ranks.

    Checkpoint coordination (who writes what, file checksums, the choice of checkpoint to
    resume) runs here, possibly from a background thread while training collectives run on
    the mesh groups: a separate group keeps the two sequences from interleaving. Every rank
    must construct it at the same point (group creation is collective)."""

    def __init__(self, world: int, timeout_s: float) -> None:
        import datetime

        self.world = world
        self.group = None
        if world > 1:
            timeout = datetime.timedelta(seconds=timeout_s)
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def all_gather(self, obj: object) -> list:
        """Every rank's `obj`, in rank order."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out
