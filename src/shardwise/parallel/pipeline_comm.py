"""Point-to-point traffic of one pipeline rank, and the group that keeps tied weights in sync.

Shapes are known ahead (micro-batch × sequence × hidden, in the compute dtype), so a receive
is posted into a buffer of the right shape without any shape handshake. Receives are posted
one pass ahead and batched with the previous pass's sends into one `batch_isend_irecv`, so a
transfer overlaps the pass before the one that needs it. Sends are never waited on during the
step — a rank blocks only on the receive its next pass needs — which with a plan that
`schedules.simulate` accepts cannot deadlock; finished sends are released as they complete.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from shardwise.distributed.comm import Comm
from shardwise.distributed.topology import Topology
from shardwise.parallel.schedules import Action, Pass


def stage_rank(topo: Topology, pp_index: int) -> int:
    """Global rank of the pipeline stage `pp_index` with this rank's dp and tp coordinates."""
    return (pp_index * topo.dp + topo.coord("dp")) * topo.tp + topo.coord("tp")


class Channel:
    """Receives and sends of one rank for one sequence of passes."""

    def __init__(self, comm: Comm, plan: list[Action], n_chunks: int, shape, dtype, device):
        topo = comm.topo
        self.comm, self.plan, self.n_chunks = comm, plan, n_chunks
        self.p, self.r = topo.pp, topo.coord("pp")
        self.next = stage_rank(topo, (self.r + 1) % self.p)
        self.prev = stage_rank(topo, (self.r - 1) % self.p)
        self.shape, self.dtype, self.device = shape, dtype, device
        self.recvs: dict[int, tuple[torch.Tensor, object]] = {}
        self.sends: list[tuple[torch.Tensor, object]] = []
        self.outbox: list[tuple[torch.Tensor, int]] = []

    def _source(self, a: Action) -> int | None:
        """The peer pass `a` receives from, if any."""
        c = a.chunk * self.p + self.r
        if a.kind is Pass.F:
            return self.prev if c > 0 else None
        if a.kind in (Pass.B, Pass.I):
            return self.next if c < self.n_chunks - 1 else None
        return None

    def send_forward(self, t: torch.Tensor) -> None:
        self.outbox.append((t.detach(), self.next))

    def send_backward(self, t: torch.Tensor) -> None:
        self.outbox.append((t.detach(), self.prev))

    def flush(self, j: int) -> None:
        """Before pass j: post the sends so far with the receive of pass j + 1 (and of pass
        j itself at the start)."""
        recvs = []
        for i in (j, j + 1) if j == 0 else (j + 1,):
            if i < len(self.plan):
                src = self._source(self.plan[i])
                if src is not None:
                    buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                    recvs.append((i, buf, src))
        works = self.comm.p2p(self.outbox, [(b, s) for _, b, s in recvs])
        n = len(self.outbox)
        self.sends += [(t, w) for (t, _), w in zip(self.outbox, works[:n], strict=True)]
        self.outbox = []
        for (i, buf, _), w in zip(recvs, works[n:], strict=True):
            self.recvs[i] = (buf, w)
        self.sends = [(t, w) for t, w in self.sends if not w.is_completed()]

    def wait(self, j: int) -> torch.Tensor | None:
        """The tensor pass j receives (blocking), or None if it receives nothing."""
        if j not in self.recvs:
            return None
        buf, work = self.recvs.pop(j)
        work.wait()
        return buf

    def close(self) -> None:
        """End of the plan: post what is left and wait for every send."""
        self.flush(len(self.plan))
        for _, w in self.sends:
            w.wait()
        self.sends = []


def tied_group(topo: Topology, timeout_s: float) -> dist.ProcessGroup | None:
    """The two-rank group (first stage, last stage) with this rank's dp and tp coordinates,
    which sums the gradients of weights both ends hold (tied embedding and head). Every rank
    creates every pair, in the same order, as `new_group` requires."""
    mine = None
    timeout = datetime.timedelta(seconds=timeout_s)
    for d in range(topo.dp):
        for t in range(topo.tp):
            pair = [d * topo.tp + t, ((topo.pp - 1) * topo.dp + d) * topo.tp + t]
            group = dist.new_group(pair, timeout=timeout, use_local_synchronization=False)
            if topo.rank in pair:
                mine = group
    return mine
