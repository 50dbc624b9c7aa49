"""The checkpoint format on disk: sharded safetensors files plus one self-describing index.

A checkpoint is a directory `<checkpoint.dir>/step-00000042/`:

* `rank-00003.safetensors` — written by rank 3 alone, holding only slices that rank owns
  (no gather to one rank). Every slice in a file is stored flat (1-D).
* `index.json` — written last by rank 0:

  ```
  {"format": "shardwise-checkpoint", "version": 1, "step": 42,
   "config": {...the resolved config...},
   "layout": {"world": 4, "pp": 1, "dp": 4, "cp": 1, "ep": 1, "tp": 1, "zero": 3,
              "compute": "fp32"},
   "loop": {"step": 42, "data": {"seed": 0, "global_batch": 8, "position": 336},
            "lr_schedule": {"step": 42, "next_lr": 0.0009},
            "loss_scaler": {"enabled": false, "scale": 1.0, "good_steps": 0},
            "optimizer": {"adam_step": 42}, "seeds": {"train": 0}},
   "files": {"rank-00003.safetensors": {"bytes": 123456, "sha256": "..."}},
   "tensors": {"master/blocks.0.attn.wq.weight": {"shape": [64, 64], "dtype": "float32",
               "slices": [{"file": "rank-00003.safetensors",
                           "key": "master/blocks.0.attn.wq.weight",
                           "box": [[0, 64], [0, 64]], "span": [3072, 4096]}, ...]}}}
  ```

Keys are `<kind>/<parameter name>` with kind `param` (the model's values in the compute
dtype), `master` (fp32 master weights, when they are separate from the parameters),
`exp_avg` / `exp_avg_sq` (AdamW moments) and `buffer` (persistent buffers, e.g. BatchNorm
statistics); names are the unsplit model's parameter names.

**A slice** is described in two steps, which covers every way shardwise cuts a tensor:
`box` is a rectangular region of the global tensor, one `[offset, length]` per dimension
(a tensor-parallel shard is a box; the whole tensor is the box `[[0, n0], [0, n1], ...]`),
and `span = [start, stop)` is a range of that box's elements in row-major order (a ZeRO
flat, padded unit cuts a parameter into such ranges; a pipeline stage simply holds whole
tensors of its layers). The file holds the span's `stop - start` elements flat under the
slice's `key` (the tensor's key, with `@` and the box offsets when the box is not the whole
tensor). The slices of one tensor are disjoint and cover it exactly once.

**Atomicity**: files are written into `step-00000042.tmp/`, fsynced, the index is written
and fsynced last, the directory renamed to its final name, and then `latest` (a one-line
file naming the newest directory) replaced atomically. A directory without the `.tmp`
suffix and with an index is complete; each file's size and SHA-256 in the index detect a
flipped byte or a truncated file.

With `checkpoint.format=dcp` the same tensors are written by torch.distributed.checkpoint
instead of the rank files, and the index says `"storage": "dcp"` (checkpoint/dcp_format.py).
Slices are read back, into any layout, by checkpoint/slices.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from shardwise.errors import CheckpointError

FORMAT, VERSION = "shardwise-checkpoint", 1
INDEX, LATEST = "index.json", "latest"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_LEFTOVER = re.compile(r"^step-\d{8}\.(tmp|deleting)$")  # what a save or a removal of ours names
# what a save writes inside: our shards and index, or DCP's files (checkpoint.format=dcp)
_OURS = re.compile(r"^(rank-\d{5}\.safetensors|index\.json|__\d+_\d+\.distcp|\.metadata(\.tmp)?)$")
_POINTER = re.compile(rb"^step-\d{8}\n$")  # what `latest` (and its temporary) holds
_SET_ASIDE = re.compile(r"^step-\d{8}\.damaged(\.\d+)?$")  # a damaged one a save replaced
# a new file only: never through a symbolic link, never over a file already there
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# a file name without any path (or DCP's `.metadata`)
_PLAIN = re.compile(r"^(\.metadata|[A-Za-z0-9_][A-Za-z0-9_.-]*)$")

Box = tuple[tuple[int, int], ...]
Span = tuple[int, int]


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one tensor: its global key, shape and dtype, and its slice."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    box: Box
    span: Span

    @property
    def numel(self) -> int:
        return self.span[1] - self.span[0]


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, int(n)) for n in shape)


def file_key(piece: Piece) -> str:
    """The slice's name inside its file: the tensor's key, plus the box's offsets when the
    box is not the whole tensor (a rank may hold several boxes of one fused weight)."""
    if piece.box == full_box(piece.shape):
        return piece.key
    return piece.key + "@" + ",".join(str(o) for o, _ in piece.box)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


# -- writing ------------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist: a planted link is never written through) and fsync."""
    with os.fdopen(os.open(path, _NEW, 0o644), "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write one rank's flat slices as a safetensors file; returns its size and SHA-256."""
    data = safetensors_bytes(tensors, metadata={"format": FORMAT})
    write_file(path, data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def leftover_name(path: Path) -> bool:
    """Whether `path` has the name of a save's temporary or a removal's (`.tmp`/`.deleting`)."""
    return bool(_LEFTOVER.match(path.name))


def ours_leftover(path: Path) -> bool:
    """A real directory holding only regular files a save writes (a killed save of ours)."""
    if path.is_symlink() or not path.is_dir():
        return False
    return all(_OURS.match(f.name) and not f.is_symlink() and f.is_file() for f in path.iterdir())


def check_pointer(root: Path) -> None:
    """Refuse a `latest.tmp` that a save of ours did not leave (a link, another file): the
    save would write through it; ours (a killed save's) is removed."""
    pointer = root / (LATEST + ".tmp")
    if not os.path.lexists(pointer):
        return
    ours = not pointer.is_symlink() and pointer.is_file() and pointer.stat().st_size < 64
    if not (ours and _POINTER.match(pointer.read_bytes())):
        raise CheckpointError(
            f"{pointer} is not a pointer a save of ours left (a symbolic link or another "
            "file): it is not written through or deleted. Fix: move it away and run again "
            "with --checkpoint.resume=auto."
        )
    os.unlink(pointer)


def commit(root: Path, tmp: Path, step: int, index: dict) -> Path:
    """Write the index into the finished temporary directory, rename it into place and point
    `latest` at it (rank 0 only). The final name must be free (the caller sets aside a
    damaged checkpoint there, and refuses to replace a valid one)."""
    check_pointer(root)
    write_file(tmp / INDEX, json.dumps(index, indent=1).encode())
    fsync_dir(tmp)
    final = step_dir(root, step)
    if os.path.lexists(final):  # never replaced here: rename() would take an empty directory
        raise CheckpointError(
            f"{final} appeared during the save (another job?): not overwritten. Fix: give one "
            "of the jobs another --checkpoint.dir."
        )
    os.rename(tmp, final)
    fsync_dir(root)
    pointer = root / (LATEST + ".tmp")
    write_file(pointer, (final.name + "\n").encode())
    os.replace(pointer, root / LATEST)  # (replaces a link named `latest`, never its target)
    fsync_dir(root)
    return final


def check_room(root: Path, need: int, key: str, copies: int = 1) -> None:
    """Refuse a job whose checkpoints (`copies` alive at once of `need` bytes each, predicted:
    those kept plus the one being written) cannot fit under `root`."""
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need * copies:
        held, keep = "the first save would fill the disk", ""
        if free >= need:  # one fits, not all those alive at once
            held = (
                f"{copies} of them are on disk at once (those kept and the one being written), "
                f"{need * copies / 1e9:.2f} GB: a later save would fill the disk"
            )
            keep = "--checkpoint.keep=<fewer>, " if copies > 2 else ""
        raise CheckpointError(
            f"{key}={root} has {free / 1e9:.2f} GB free, and one checkpoint of this job takes "
            f"about {need / 1e9:.2f} GB; {held}. Fix: free space there, {keep}or "
            f"--{key}=<a directory with room>."
        )


def remove(path: Path) -> None:
    """Delete a checkpoint directory so that a crash midway never leaves a complete-looking
    one: it is renamed away first (a leftover `.deleting` directory is never loaded)."""
    doomed = path.with_name(path.name + ".deleting")
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# -- finding and checking -----------------------------------------------------------------------
def list_complete(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (final name, index present), newest first."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / INDEX).is_file():
            out.append((int(m.group(1)), child))
    return sorted(out, reverse=True)


def list_unfinished(root: Path) -> tuple[list[Path], list[Path]]:
    """(ours, kept): directories a killed save or deletion of ours left behind — the name
    (`step-NNNNNNNN.tmp` / `.deleting`) and every entry in them (rank shards, the index) are
    what a save writes, so removing them deletes nothing else — and the others that look
    unfinished (a final name without its index, or foreign files inside), which are only
    reported: the user's files are never deleted."""
    if not root.is_dir():
        return [], []
    ours, kept = [], []
    for c in sorted(root.iterdir()):
        if not c.name.startswith("step-") or _SET_ASIDE.match(c.name):
            continue  # (a damaged checkpoint set aside was reported when it was)
        if _LEFTOVER.match(c.name) and ours_leftover(c):
            ours.append(c)
        elif c.is_symlink() or (c.is_dir() and not _STEP_DIR.match(c.name)):
            kept.append(c)  # a link is never followed to delete what it points to
        elif c.is_dir() and not (c / INDEX).is_file():
            kept.append(c)
    return ours, kept


def plain_file_names(index: dict) -> list[str]:
    """Problems with the file names an index gives (each must be a plain name inside the
    checkpoint directory: no separator, no `..`, not absolute)."""
    names = set(index.get("files", {}))
    for entry in index.get("tensors", {}).values():
        names |= {s.get("file", "") for s in entry.get("slices", [])}
    bad = sorted(n for n in names if not _PLAIN.match(str(n)) or n in (".", ".."))
    return [f"index.json names files outside the checkpoint directory: {bad[:5]}"] if bad else []


def read_index(path: Path | str) -> dict:
    path = Path(path)
    index = json.loads((path / INDEX).read_text())
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{path / INDEX} is not a {FORMAT} v{VERSION} index")
    bad = plain_file_names(index)
    if bad:  # a hostile or broken index must not make us open files elsewhere
        raise ValueError(f"{path / INDEX}: {bad[0]}")
    return index


def check_files(path: Path, files: dict[str, dict]) -> list[str]:
    """Problems with `files` of the checkpoint at `path` (missing, wrong size, checksum)."""
    problems = []
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            problems.append(f"{f}: missing")
            continue
        size = f.stat().st_size
        if size != info["bytes"]:
            problems.append(f"{f}: {size} bytes, the index says {info['bytes']} (truncated?)")
            continue
        digest = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
        if digest.hexdigest() != info["sha256"]:
            problems.append(f"{f}: SHA-256 differs from the index (corrupted)")
    return problems


def check_index(path: Path) -> tuple[dict | None, list[str]]:
    """The parsed index and its problems (a checkpoint is valid when the list is empty)."""
    try:
        return read_index(path), []
    except (OSError, ValueError, KeyError) as exc:
        return None, [f"{path / INDEX}: unreadable ({exc})"]


def latest(root: Path) -> Path | None:
    """The checkpoint `root/latest` names (the newest completed save), if any."""
    pointer = root / LATEST
    return root / pointer.read_text().strip() if pointer.is_file() else None
