"""`checkpoint.format=dcp`: a step directory written and read by torch.distributed.checkpoint.

The tensors are the ones our own format stores (`state.local_state`: `param/...`,
`master/...`, `exp_avg/...`, `exp_avg_sq/...`, `buffer/...`, keyed by the unsplit model's
names, at full shape), each rank describing to DCP the slices it owns (`state.assign_writers`)
instead of writing them into its safetensors file. Nothing is gathered: a slice of ours is a
flat run of elements inside a rectangular box (a ZeRO span inside a tensor-parallel box), which
is a union of at most 2·ndim − 1 rectangles of the global tensor; each rectangle is one DCP
chunk, with its global offsets and sizes. DCP checks that the chunks of every tensor tile it
exactly (`_validate_global_plan`) and, on load, reads from whichever chunks overlap what a rank
now needs, so any layout resumes any other.

The step directory keeps our `index.json` beside DCP's `.metadata` and `__<rank>_<n>.distcp`
files: the loop and data state, the layout, every tensor's shape and dtype (`"storage": "dcp"`,
no slices: DCP's metadata has them) and the size and SHA-256 of every file, so the pre-launch
check, `latest`, pruning and the damaged-checkpoint checks work as for our own format.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardwise.checkpoint import io as io

STORAGE = "dcp"  # index["storage"] of a step directory written here
METADATA = ".metadata"  # DCP's global metadata file (written last, by rank 0)
Rect = tuple[tuple[int, ...], tuple[int, ...], int, int]  # offsets, sizes, flat [lo, hi)


def rects(shape: tuple[int, ...], lo: int, hi: int) -> list[Rect]:
    """The rectangles whose union is elements [lo, hi) of a tensor of `shape` in row-major
    order, in that order; each is a contiguous flat run [a, b) of it."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,) if shape else (), (hi - lo,) if shape else (), lo, hi)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    out: list[Rect] = []

    def rows(row: int, a: int, b: int) -> None:  # a part of one row: the inner shape's rects
        for off, size, x, y in rects(shape[1:], a - row * inner, b - row * inner):
            out.append(((row, *off), (1, *size), x + row * inner, y + row * inner))

    if lo % inner:  # a partial first row
        end = min(hi, (lo // inner + 1) * inner)
        rows(lo // inner, lo, end)
        lo = end
    whole = hi // inner
    if lo < hi and whole > lo // inner:  # whole rows: one rectangle
        out.append(
            (
                (lo // inner, *[0] * (len(shape) - 1)),
                (whole - lo // inner, *shape[1:]),
                lo,
                whole * inner,
            )
        )
        lo = whole * inner
    if lo < hi:  # a partial last row
        rows(lo // inner, lo, hi)
    return out


def chunks(piece: io.Piece) -> list[Rect]:
    """DCP chunks of one stored slice: global offsets, sizes, and the range of the slice's
    flat values each holds."""
    box_shape = tuple(n for _, n in piece.box)
    out = []
    for off, size, a, b in rects(box_shape, *piece.span):
        where = tuple(o + bo for o, (bo, _) in zip(off, piece.box, strict=True))
        out.append((where, size, a - piece.span[0], b - piece.span[0]))
    return out


class _Writes(DefaultSavePlanner):
    """Save planner for the slices this rank owns, described as chunks of the global tensors
    (the default planner then dedups, checks that chunks tile each tensor, and writes)."""

    def __init__(self, slices: dict[io.Piece, torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.data: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.items: list[WriteItem] = []
        for piece, values in slices.items():
            props = TensorProperties(dtype=values.dtype)
            for where, size, a, b in chunks(piece):
                chunk = ChunkStorageMetadata(torch.Size(where), torch.Size(size))
                self.data[(piece.key, where)] = values[a:b].view(size)
                self.items.append(
                    WriteItem(
                        index=MetadataIndex(piece.key, torch.Size(where)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk, props, torch.Size(piece.shape)),
                    )
                )

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self.items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.data[(index.fqn, tuple(index.offset))]


class _Reads(DefaultLoadPlanner):
    """Load planner filling this rank's slices (each a set of chunks of host buffers) from
    whatever chunks the checkpoint holds: DCP intersects them (resharding)."""

    def __init__(self, wanted: dict[str, list[tuple[Rect, torch.Tensor]]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.wanted = wanted
        self.buffers: dict[tuple[str, tuple[int, ...]], list[torch.Tensor]] = {}
        for fqn, parts in wanted.items():
            for (where, *_), view in parts:
                self.buffers.setdefault((fqn, where), []).append(view)

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for fqn in self.wanted:  # (index.json's shapes were checked against this run)
            md = self.metadata.state_dict_metadata[fqn]
            local = [
                ChunkStorageMetadata(torch.Size(w), torch.Size(s))
                for w, s in dict.fromkeys((w, s) for (w, s, _, _), _ in self.wanted[fqn])
            ]
            requests += create_read_items_for_chunk_list(fqn, md, local)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.buffers[(index.fqn, tuple(index.offset))][0]

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        # two slices of this rank read from one stored chunk (e.g. a parameter and its master
        # both taken from the fp32 master): the first received it, the others copy it
        key = (read_item.dest_index.fqn, tuple(read_item.dest_index.offset))
        for other in self.buffers[key][1:]:
            self.transform_tensor(read_item, other).copy_(tensor)


def _call(fn, **kw) -> None:
    """Run dcp.save/load; a storage failure on any rank comes back as OSError's text."""
    with warnings.catch_warnings():  # DCP warns that it assumes one process: there is one
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            fn(**kw)
        except CheckpointException as exc:  # raised alike on every rank (DCP gathers them)
            raise OSError(str(exc)) from exc


def _collective(fn, group, world: int, **kw) -> None:
    """dcp.save/load of our planner's slices (no state_dict of DCP's own) over `group`; one
    process runs it without a process group."""
    _call(fn, state_dict={}, process_group=group, no_dist=world == 1, **kw)


def file_info(path: Path) -> dict:
    """Size and SHA-256 of one written file, as our index records them."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def write(tmp: Path, slices: dict[io.Piece, torch.Tensor], rank: int, group, world: int) -> dict:
    """Write this rank's owned slices into `tmp` with dcp.save (collective over `group`);
    returns the files this rank wrote (rank 0: DCP's metadata too) with size and SHA-256."""
    writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True)
    _collective(dcp.save, group, world, storage_writer=writer, planner=_Writes(slices))
    mine = sorted(
        n for n in os.listdir(tmp) if n.startswith(f"__{rank}_") and n.endswith(".distcp")
    )
    if rank == 0:
        mine.append(METADATA)
    return {name: file_info(tmp / name) for name in mine}


def load(path: Path, wanted: list[tuple[io.Piece, str, torch.Tensor]], group, world: int) -> None:
    """Fill each flat host buffer with the elements of its slice (`piece`'s box and span),
    read from the stored tensor `source`; dcp.load is collective over `group`."""
    parts: dict[str, list[tuple[Rect, torch.Tensor]]] = {}
    for piece, source, buf in wanted:
        for rect in chunks(piece):
            parts.setdefault(source, []).append((rect, buf[rect[2] : rect[3]].view(rect[1])))
    reader = dcp.FileSystemReader(str(path))
    _collective(dcp.load, group, world, storage_reader=reader, planner=_Reads(parts))


def read_full(path: Path, key: str, entry: dict) -> torch.Tensor:
    """One stored tensor at its full shape (export, inspection), in this process alone."""
    return read_all(path, {key: entry})[key]


def read_all(path: Path, entries: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Several stored tensors (index.json's `tensors` entries) at full shape, in one dcp.load
    (DCP assembles each from its chunks), in this process alone."""
    out = {
        k: torch.empty(tuple(e["shape"]), dtype=getattr(torch, e["dtype"]))
        for k, e in entries.items()
    }
    _call(dcp.load, state_dict=out, checkpoint_id=str(path), no_dist=True)
    return out


def manifest(index: dict) -> dict:
    """Our index for a DCP step directory: the same, its tensors without slices (DCP's
    metadata places them)."""
    index["storage"] = STORAGE
    index["tensors"] = {
        k: {"shape": e["shape"], "dtype": e["dtype"]} for k, e in index["tensors"].items()
    }
    return index
