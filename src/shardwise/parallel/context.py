"""Context parallelism: each sample's sequence split over the cp ranks of a run, as a
transformation of a plain decoder (ring attention, Liu et al. 2023; DeepSpeed-Ulysses,
Jacobs et al. 2023).

A rank holds chunks i and 2cp-1-i of 2cp equal chunks of every sequence (the zig-zag split of
Megatron-LM and Llama 3), so causal attention costs every rank the same. The engine gives the
model only those tokens and targets (`sequence_part`); the attention cores get a
`SequenceContext` that hands RoPE the global positions and attends over the whole sequence
with the kernels of parallel/context_comm.py; a learned position table (GPT-2) is read at the
global positions too. transformers' Llama-style models attend through the same kernels from
their attention registry (parallel/context_hf.py), packed rows included. Everything else in
a block works token by token and needs nothing.

Packed rows (data.pack, models/packing.py) are split the same way: `sequence_part` hands the
model [B, 3, S/cp] (ids, record numbers, positions within the record counted on the whole
row), RoPE (or GPT-2's table) reads those positions as in one process, and the kernels mask
per record from where each local query's record starts (its global position minus its
position in the record).

Why the numbers do not change: the loss is the sum over this rank's tokens divided by the
*global* token count, and gradients are summed over dp, which holds the cp ranks
(distributed/topology.py), so the sum of the parts is the single-device gradient."""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from torch import nn

from shardwise.distributed.comm import Comm
from shardwise.distributed.topology import Topology
from shardwise.models.decoder import AttentionCore, Decoder
from shardwise.models.packing import Packed, is_packed, packed_part
from shardwise.parallel.context_comm import ring_attention, ulysses_attention, zigzag_positions
from shardwise.parallel.context_hf import apply_to_transformers


class SequenceContext:
    """What an attention core needs to attend over a sequence split over the cp ranks."""

    def __init__(self, comm: Comm, mode: Literal["ring", "ulysses"]) -> None:
        self.comm = comm
        self.cp, self.index = comm.topo.size("cp"), comm.topo.coord("cp")
        self.kernel = ring_attention if mode == "ring" else ulysses_attention
        self._cache: dict[tuple[int, str], torch.Tensor] = {}
        # the packed rows of a transformers model's current forward (context_hf.py sets it in a
        # forward pre-hook): its attention function is handed no argument that could carry them
        self.packed: Packed | None = None

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions [local_len] of this rank's tokens (the same every forward)."""
        key = (local_len, str(device))
        if key not in self._cache:
            self._cache[key] = zigzag_positions(local_len * self.cp, self.cp, self.index, device)
        return self._cache[key]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed | None = None
    ) -> torch.Tensor:
        """Causal attention of this rank's queries over every rank's keys (within each
        query's record for `packed` rows); [B, H, S_local, D]."""
        positions = self.positions(q.shape[2], q.device)
        starts = None if packed is None else positions[None, :] - packed.positions
        return self.kernel(q, k, v, positions, self.comm, starts)


def sequence_part(t: torch.Tensor, topo: Topology) -> torch.Tensor:
    """This rank's tokens of each sample: [B, S, ...] -> [B, S / cp, ...], a packed batch
    [B, 2, S] -> [B, 3, S / cp] (models/packing.py `packed_part`); cp = 1: `t`."""
    if topo.cp == 1:
        return t
    if is_packed(t):
        return packed_part(t, zigzag_positions(t.shape[2], topo.cp, topo.coord("cp"), t.device))
    return t[:, zigzag_positions(t.shape[1], topo.cp, topo.coord("cp"), t.device)]


def apply_context_parallel(
    model: nn.Module, comm: Comm, mode: Literal["ring", "ulysses"]
) -> SequenceContext | None:
    """Hand every attention core of `model` the cp context (and a learned position table its
    positions), or a transformers model's attention and positions (context_hf.py); a no-op at
    cp = 1. Parameters are untouched: names, init and ZeRO units stay."""
    if comm.topo.size("cp") == 1:
        return None
    context = SequenceContext(comm, mode)
    if apply_to_transformers(model, context):
        return context
    for module in model.modules():
        if isinstance(module, AttentionCore):
            module.context = context
        if isinstance(module, Decoder) and module.pos_embed is not None:
            module.pos_embed.register_forward_pre_hook(partial(_global_positions, context))
    return context


def _global_positions(context: SequenceContext, _module: nn.Module, args: tuple) -> tuple:
    """The decoder looks its table up at local positions 0..S/cp-1 [S/cp]: map them to the
    global ones. Packed rows' positions [B, S/cp] are within the record already."""
    local = args[0]
    if local.dim() != 1:
        return args
    return (context.positions(len(local), local.device)[local],)
