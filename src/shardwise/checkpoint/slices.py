"""Reading a checkpoint's slices (checkpoint/io.py describes the format): a rank's piece filled
from every stored slice that overlaps it, in any layout, or one tensor at its full shape.

Loading intersects what each rank needs now with every stored slice: two spans of the same box
directly, different boxes (a tensor cut differently, e.g. tp2 -> tp1) by index arithmetic.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import safe_open

from shardwise.checkpoint import io
from shardwise.errors import CheckpointError


class ShardReader:
    """Opens each file of one checkpoint once and reads flat ranges of its tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._open: dict[str, object] = {}
        self._stack = contextlib.ExitStack()

    def read(self, file: str, key: str, a: int, b: int) -> torch.Tensor:
        handle = self._open.get(file)
        if handle is None:
            handle = self._stack.enter_context(safe_open(self.path / file, framework="pt"))
            self._open[file] = handle
        return handle.get_slice(key)[a:b]

    def close(self) -> None:
        self._stack.close()


def _positions(region: io.Box, box: io.Box) -> torch.Tensor:
    """Row-major element indices, inside `box`, of every element of `region` (⊆ box), in the
    region's own row-major order."""
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    strides = []
    for _, length in reversed(box):
        strides.append(stride)
        stride *= length
    strides.reverse()
    for d, ((off, length), (boff, _)) in enumerate(zip(region, box, strict=True)):
        axis = (torch.arange(length, dtype=torch.int64) + (off - boff)) * strides[d]
        idx = idx.unsqueeze(-1) + axis
    return idx.reshape(-1)


def copy_overlap(dst: torch.Tensor, need: io.Piece, have: dict, reader: ShardReader) -> int:
    """Copy the elements `need` (a rank's slice, `dst` its flat storage) shares with one
    stored slice `have`; returns how many were copied."""
    hbox = tuple(tuple(x) for x in have["box"])
    h0, h1 = have["span"]
    if hbox == need.box:  # the same region (no tp change): two flat ranges intersect
        a, b = max(need.span[0], h0), min(need.span[1], h1)
        if a >= b:
            return 0
        src = reader.read(have["file"], have["key"], a - h0, b - h0)
        dst[a - need.span[0] : b - need.span[0]].copy_(src)
        return b - a
    # General case (a box cut differently, e.g. tp2 -> tp1): index arithmetic over the
    # boxes' intersection; costs one int64 per element of that intersection.
    region = []
    for (no, nl), (ho, hl) in zip(need.box, hbox, strict=True):
        lo, hi = max(no, ho), min(no + nl, ho + hl)
        if lo >= hi:
            return 0
        region.append((lo, hi - lo))
    region = tuple(region)
    at_need, at_have = _positions(region, need.box), _positions(region, hbox)
    keep = (at_need >= need.span[0]) & (at_need < need.span[1])
    keep &= (at_have >= h0) & (at_have < h1)
    if not bool(keep.any()):
        return 0
    at_need, at_have = at_need[keep], at_have[keep]
    lo, hi = int(at_have.min()), int(at_have.max()) + 1
    src = reader.read(have["file"], have["key"], lo - h0, hi - h0)
    dst[at_need - need.span[0]] = src[at_have - lo].to(dst.dtype)
    return int(at_need.numel())


def load_piece(dst: torch.Tensor, need: io.Piece, entry: dict, reader: ShardReader) -> None:
    """Fill `dst` (flat, `need.numel` elements) from every stored slice that overlaps it."""
    got = sum(copy_overlap(dst, need, have, reader) for have in entry["slices"])
    if got != need.numel:
        raise ValueError(
            f"{need.key}: the checkpoint's slices cover {got} of the {need.numel} elements "
            "this rank needs"
        )


def read_tensor(path: Path | str, key: str, index: dict | None = None) -> torch.Tensor:
    """One stored tensor at its full global shape, assembled from all its slices (for export
    and inspection; training ranks read only their own slices)."""
    path = Path(path)
    index = index if index is not None else io.read_index(path)
    entry = index["tensors"][key]
    if index.get("storage") == "dcp":  # (checkpoint/dcp_format.py reads those)
        raise CheckpointError(
            f"{path} was saved with checkpoint.format=dcp: its tensors are DCP's files, read "
            "by checkpoint/dcp_format.read_full (export reads either format)."
        )
    shape = tuple(entry["shape"])
    out = torch.empty(shape, dtype=getattr(torch, entry["dtype"]))
    need = io.Piece(key, shape, entry["dtype"], io.full_box(shape), (0, out.numel()))
    reader = ShardReader(path)
    try:
        load_piece(out.view(-1), need, entry, reader)
    finally:
        reader.close()
    return out
