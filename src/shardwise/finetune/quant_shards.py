"""How a quantised base weight (finetune/quant.py) is split over ranks and what it costs in
bytes: the engine's `QuantLinear` stores and gathers its blocks by these rules, and the planner
(plan/memory.py, plan/traffic.py) prices the same rules without building a layer.

Under ZeRO-3 (over dp) and tensor parallelism (over tp) each rank keeps 1/n of every quantised
weight (n = dp·tp, dp outer): a run of whole blocks (`Shards`: 64 weights for nf4, a row for
int8), gathered as bytes (over tp, then dp) for one use at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NF4_BLOCK = 64  # weights per absmax block (QLoRA's choice)
ABSMAX_BLOCK = 256  # absmax values per block of the double quantisation (bitsandbytes')


def split_dims(dp: int, tp: int, zero: int) -> tuple[tuple[str, int], ...]:
    """The (mesh dim, ranks) each quantised weight is split over, outer first: ZeRO-3's dp,
    then tp; dims of one rank left out (the engine and the planner both ask here)."""
    return tuple((d, n) for d, n in (("dp", dp if zero == 3 else 1), ("tp", tp)) if n > 1)


def split_index(comm, dims: tuple[tuple[str, int], ...]) -> int:
    """This rank's index among the n = prod(sizes) ranks a weight is split over, `dims`
    outer first (dp, then tp)."""
    index = 0
    for dim, size in dims:
        index = index * size + comm.topo.coord(dim)
    return index


def gather_split(comm, part: torch.Tensor, dims: tuple[tuple[str, int], ...]) -> list:
    """All-gather `part` over `dims`, innermost first, so the result is in split_index order;
    every buffer it made, the last the whole."""
    made = []
    for dim, size in reversed(dims):
        full = torch.empty(part.numel() * size, dtype=part.dtype, device=part.device)
        comm.all_gather(full, part, dim)
        made.append(full)
        part = full
    return made


@dataclass(frozen=True)
class Shards:
    """How one [out, in] weight in format `kind` is split over `n` ranks: `chunk` whole
    blocks each (the last ranks may hold fewer real ones; every rank stores `chunk`, so the
    gather is one equal-sized all-gather). A block is 64 weights (nf4) or a row (int8)."""

    out_features: int
    in_features: int
    n: int = 1
    kind: str = "nf4"

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    @property
    def block(self) -> int:
        return NF4_BLOCK if self.kind == "nf4" else self.in_features

    @property
    def blocks(self) -> int:
        return -(-self.numel // self.block)

    @property
    def chunk(self) -> int:
        return -(-self.blocks // self.n)

    def span(self, rank: int) -> tuple[int, int]:
        """The elements [start, stop) of the flattened weight rank `rank` quantises."""
        start = min(self.numel, rank * self.chunk * self.block)
        return start, min(self.numel, start + self.chunk * self.block)

    @property
    def code_bytes(self) -> int:
        """Codes one rank stores: nf4 two per byte, int8 one."""
        if self.kind == "int8":
            return self.chunk * self.block
        return -(-self.numel // 2) if self.n == 1 else self.chunk * NF4_BLOCK // 2

    @property
    def stat_bytes(self) -> int:
        """Block statistics one rank stores: an 8-bit absmax (nf4) or an fp32 one (int8)."""
        return self.chunk * (1 if self.kind == "nf4" else 4)


def layer_bytes(out_features: int, in_features: int, shards: int = 1, kind: str = "nf4") -> int:
    """Bytes one rank keeps for one quantised weight split over `shards` ranks: its
    share of the codes and block statistics (nf4: 4 bits per weight, an 8-bit absmax per 64;
    int8: a byte per weight, an fp32 absmax per row), and for nf4 on every rank the 16-entry
    NF4 map (fp32), an fp32 absmax per 256 blocks, the 256-entry map of the absmax
    quantisation (fp32) and their fp32 mean."""
    s = Shards(out_features, in_features, shards, kind)
    if kind == "int8":
        return s.code_bytes + s.stat_bytes
    return s.code_bytes + s.stat_bytes + 16 * 4 + 4 * -(-s.blocks // ABSMAX_BLOCK) + 256 * 4 + 4


def gather_steps(out_features: int, in_features: int, sizes, kind: str = "nf4") -> list[int]:
    """Bytes of the whole buffer each all-gather of one use makes, for a weight split over
    ranks of `sizes` (outer first), innermost first; none when it is whole here."""
    n = math.prod(sizes)
    if n == 1:
        return []
    s = Shards(out_features, in_features, n, kind)
    part, out = s.code_bytes + s.stat_bytes, []
    for size in reversed(sizes):
        part *= size
        out.append(part)
    return out


def transient_bytes(
    out_features: int, in_features: int, sizes, itemsize: int, kind: str = "nf4"
) -> int:
    """Bytes one use of a quantised weight holds at once (`QuantLinear.weight_for`): the
    gathers, the codes and statistics cut out of the last, this rank's part sent, and the
    weight dequantised to `itemsize`-byte floats."""
    steps = gather_steps(out_features, in_features, sizes, kind)
    held = sum(steps) + steps[-1] + steps[-1] // math.prod(sizes) if steps else 0
    return held + out_features * in_features * itemsize
