"""The steps of one save on disk, as `Checkpointer` (checkpoint/manager.py) runs them: a rank
writes its files, rank 0 commits the directory and prunes the line past `checkpoint.keep`, and
a failure on any rank becomes one message that every rank raises.

`good` is the Checkpointer's record of the checkpoints this job verified (name: ok), so a
checkpoint it loaded or wrote is never hashed again to count toward `checkpoint.keep`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from shardwise.checkpoint import dcp_format, lineage
from shardwise.checkpoint import io as io
from shardwise.checkpoint.refusals import every_rank
from shardwise.distributed.comm import ControlChannel
from shardwise.errors import CheckpointError


def warn(message: str) -> None:
    """One warning line on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def attempt(action, doing: str):
    """`action()`'s result, or what every rank is told of its failure: an OSError's reason
    (`doing` names the path), or a refusal's whole message."""
    try:
        return action()
    except CheckpointError as exc:
        return ("refused", str(exc))
    except OSError as exc:
        return f"{doing}: {exc.strerror or exc}"


def write_files(
    tmp: Path,
    tensors: dict[io.Piece, torch.Tensor],
    rank: int,
    channel: ControlChannel,
    world: int,
    fmt: str,
) -> dict[str, dict]:
    """Write this rank's slices into `tmp`; returns its files' sizes and SHA-256."""
    if fmt == "dcp":  # collective: every rank takes part, owner or not
        return dcp_format.write(tmp, tensors, rank, channel.group, world)
    if not tensors:
        return {}
    name, flat = io.shard_name(rank), {io.file_key(p): t for p, t in tensors.items()}
    return {name: io.write_shard(tmp / name, flat)}


def commit(root: Path, tmp: Path, step: int, index: dict, good: dict[str, bool]) -> None:
    """Rank 0: put the finished save in place. A checkpoint already at its name is another
    line's or run's: a valid one is never replaced, a damaged one is set aside."""
    final = io.step_dir(root, step)
    if os.path.lexists(final):
        problems = damage(final)
        if not problems:
            raise CheckpointError(
                f"{final} already holds a valid checkpoint of another line or run, which "
                f"is never overwritten; this save was left in {tmp.name}. Fix: "
                "--checkpoint.dir=<another directory> for this run."
            )
        aside = lineage.set_aside(final)
        warn(f"{final} is damaged ({problems[0]}): moved to {aside.name} to save in its place")
    io.commit(root, tmp, step, index)
    good[final.name] = True  # written and fsynced by this job


def damage(path: Path) -> list[str]:
    """Problems of one checkpoint, checked by rank 0 alone (index, files' sizes, SHA-256)."""
    index, problems = io.check_index(path)
    return problems or io.check_files(path, index.get("files", {}))


def verified(entry: lineage.Entry, good: dict[str, bool]) -> bool:
    """Counts toward checkpoint.keep: loaded or written by this job, or its index readable
    and every file it lists there at its size (hashing every kept checkpoint at each save
    would cost a full read of each)."""
    if entry.path.name not in good:
        files = (entry.index or {}).get("files", {})
        good[entry.path.name] = bool(files) and all(
            (entry.path / n).is_file() and (entry.path / n).stat().st_size == f["bytes"]
            for n, f in files.items()
        )
    return good[entry.path.name]


def prune(root: Path, history: list[dict], step: int, keep: int, good: dict[str, bool]) -> None:
    """Rank 0, after a save: delete the checkpoints of this line past checkpoint.keep,
    only the files their index lists (a failure here only warns: the save is in place)."""
    try:
        old = lineage.doomed(root, history, step, keep, lambda entry: verified(entry, good))
        for entry in old:
            foreign = lineage.prune(entry.path, entry.index)
            if foreign:
                warn(
                    f"pruned checkpoint {entry.path}: deleted its own files only; the "
                    f"directory stays with {len(foreign)} other entr"
                    f"{'y' if len(foreign) == 1 else 'ies'} ({', '.join(foreign[:5])})"
                )
    except OSError as exc:
        warn(f"pruning old checkpoints in {root} failed ({exc}); they are kept")


def raise_failed(root: Path, step: int, reports: list) -> None:
    """Raise one message for every rank's failures (each rank raises it)."""
    refusals = [r[1] for r in reports if isinstance(r, tuple) and r[0] == "refused"]
    if refusals:
        raise every_rank(CheckpointError(refusals[0]))
    errors: dict[str, list[int]] = {}
    for rank, r in enumerate(reports):
        if isinstance(r, str):
            errors.setdefault(r, []).append(rank)
    if not errors:
        return
    kept = io.latest(root)
    said = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {text}"
        for text, ranks in errors.items()
    )
    left = f"the last complete checkpoint, {kept}, is kept" if kept else "no checkpoint yet"
    raise every_rank(
        CheckpointError(
            f"saving step {step} failed ({said}); {left}. Fix: free space in (or repair) "
            f"{root}, or point --checkpoint.dir elsewhere, and run again with "
            "--checkpoint.resume=auto."
        )
    )
