"""Expert parallelism's token exchange (GShard, Lepikhin et al. 2020; Megatron-Core's
all-to-all token dispatcher): the rows a rank routed to experts held elsewhere are sent there,
computed, and sent back.

Per MoE layer and micro-batch, along the `ep` group of n ranks each holding E/n experts
(contiguous: rank i holds experts [i·E/n, (i+1)·E/n)):
1. counts: every rank's per-expert row counts [E] are exchanged (an equal all-to-all of n·E/n
   int64), so each rank knows how many rows it receives from whom;
2. dispatch: the rows, sorted by global expert, go to the rank holding their expert (an uneven
   all-to-all); they arrive ordered by (source rank, local expert) and are regrouped by local
   expert for the grouped matmul;
3. combine: the outputs go back the same way, reversed.
The backward of each uneven all-to-all is the reverse all-to-all of the gradients
(`_AllToAll`). So a layer costs 3 calls forward and 2 backward; the bytes depend on the
routing (distributed/comm.py counts what each rank actually sends to the others)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardwise.distributed.comm import Comm

Experts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """Rows `in_rows[j]` of x to ep index j, `out_rows[i]` rows from index i; the backward
    sends the gradients back along the reverse splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_rows: list[int], in_rows: list[int], comm: Comm):
        ctx.comm, ctx.out_rows, ctx.in_rows = comm, out_rows, in_rows
        out = x.new_empty((sum(out_rows), *x.shape[1:]))
        comm.all_to_all_v(out, x.contiguous(), out_rows, in_rows, "ep")
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        grad = g.new_empty((sum(ctx.in_rows), *g.shape[1:]))
        ctx.comm.all_to_all_v(grad, g.contiguous(), ctx.in_rows, ctx.out_rows, "ep")
        return grad, None, None, None


class ExpertExchange:
    """What an MoE layer (models/moe.py) calls instead of its experts under expert
    parallelism: rows sorted by global expert in, their outputs in the same order out."""

    def __init__(self, comm: Comm, n_experts: int) -> None:
        self.comm = comm
        self.n, self.index = comm.topo.size("ep"), comm.topo.coord("ep")
        self.local = n_experts // self.n  # experts per rank
        self.first = self.index * self.local  # this rank's first (global) expert

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """`xs` [sum(counts), d] grouped by global expert (`counts` [E]); `experts(rows,
        local_counts)` computes this rank's experts on rows grouped by local expert."""
        n, local = self.n, self.local
        send = counts.reshape(n, local).contiguous()
        recv = torch.empty_like(send)  # recv[i, e]: rows from rank i for local expert e
        self.comm.all_to_all(recv, send, "ep")
        in_rows, out_rows = send.sum(1).tolist(), recv.sum(1).tolist()  # the one host sync
        got = _AllToAll.apply(xs, out_rows, in_rows, self.comm)
        # arrived by (source, local expert); the grouped matmul wants (local expert, source)
        key = torch.arange(n * local, device=xs.device).repeat_interleave(recv.reshape(-1))
        order = torch.argsort((key % local) * n + key // local, stable=True)
        y = experts(got[order], recv.sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(y[back], in_rows, out_rows, self.comm)


class SequenceShards:
    """What an MoE layer (models/moe.py) asks when sequence parallelism splits its sequences
    over the tp ranks (rank i holds positions [i·S/n, (i+1)·S/n) of each): the per-sequence
    counts of the other shards, so capacity and the balance loss are decided on the whole
    sequence as on one process. The experts are not split by tp (Megatron-Core's expert
    tensor parallel size 1): each rank routes its own tokens through whole experts."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.n, self.index = comm.topo.size("tp"), comm.topo.coord("tp")

    def counts(self, per_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the whole sequences' counts, those of the shards before this one) of this shard's
        per-(sequence, expert) chosen counts [B, E] (one all-gather over tp)."""
        every = per_row.new_empty((self.n * per_row.shape[0], *per_row.shape[1:]))
        self.comm.all_gather(every, per_row.contiguous(), "tp")
        every = every.view(self.n, *per_row.shape)
        return every.sum(0), every[: self.index].sum(0)
