"""The line of saves a run continues, and what a save may write or delete in checkpoint.dir.

Every index carries `history`, the jobs whose saves this state descends from, newest first:
`[{"run": "<id of this job>", "from": 12}, {"run": "<id of the job before>", "from": 0}]`
(`from`: the step that job resumed at). A checkpoint X is *on the line* of a checkpoint C when
one of C's segments is X's job and X's step is at most where the next newer segment started
(C's own step for the first). A rollback (`checkpoint.resume=.../step-00000002` in a
checkpoint.dir that also holds steps 4 and 6) starts a new line: 4 and 6 are off it.

`latest` names the newest save. `resume=auto` follows it (or a save on its line that a kill
kept from updating it), then its line backwards past damaged ones; a checkpoint off the line
is never loaded, and never pruned. Pruning deletes only files a checkpoint's own index lists,
keeps `checkpoint.keep` checkpoints that verify (a damaged one does not count), and never
writes or deletes through a symbolic link.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.checkpoint import io
from shardwise.errors import CheckpointError

if TYPE_CHECKING:
    from shardwise.config import Config

HISTORY = "history"


@dataclass
class Entry:
    """A complete checkpoint: its step, directory and index (None: unreadable)."""

    step: int
    path: Path
    index: dict | None


def history_of(index: dict) -> list[dict]:
    """An index's history; one without (saved before histories were) is a line of unknown
    jobs, all of whose checkpoints count as one line."""
    return index.get(HISTORY) or [{"run": None, "from": 0}]


def start(parent: dict | None, step: int) -> list[dict]:
    """The history of a job starting at `step` from the checkpoint whose index is `parent`
    (None: a fresh start)."""
    older = [] if parent is None else history_of(parent)
    return [{"run": uuid.uuid4().hex[:16], "from": step}, *older]


def on_line(history: list[dict], step: int, other: Entry) -> bool:
    """Whether `other` is on the line of the state with `history` at `step` (or is it)."""
    if other.index is None:
        return False
    run, bound = history_of(other.index)[0].get("run"), step
    for segment in history:
        if segment.get("run") == run and other.step <= bound:
            return True
        bound = segment.get("from", 0)
    return False


def entries(root: Path) -> list[Entry]:
    """The complete checkpoints under `root`, newest step first, with their indexes."""
    return [Entry(s, p, io.check_index(p)[0]) for s, p in io.list_complete(root)]


def resume_order(root: Path) -> tuple[list[Entry], list[Entry]]:
    """(the checkpoints `resume=auto` tries, in order; the others, off the line)."""
    found = entries(root)
    newest = io.latest(root)
    head = next((e for e in found if newest is not None and e.path.name == newest.name), None)
    if head is None:  # no pointer (or it names no complete checkpoint): by step
        return found, []
    if head.index is None:  # the line is unknown: older steps only
        order = [head] + [e for e in found if e.step < head.step]
    else:
        # a save on the line whose pointer update a kill prevented is newer than `latest`
        ahead = [
            e
            for e in found
            if e.step > head.step and e.index and on_line(history_of(e.index), e.step, head)
        ]
        history = history_of(head.index)
        back = [e for e in found if e.step < head.step and on_line(history, head.step, e)]
        order = [*ahead, head, *back]
    names = {e.path.name for e in order}
    return order, [e for e in found if e.path.name not in names]


def doomed(
    root: Path, history: list[dict], step: int, keep: int, verified: Callable[[Entry], bool]
) -> list[Entry]:
    """The checkpoints a save of `step` prunes: those on its line (real directories with a
    readable index) past the newest `keep` that verify. None while fewer verify: a damaged
    checkpoint never counts, so the last good one is never deleted."""
    line = [e for e in entries(root) if not e.path.is_symlink() and on_line(history, step, e)]
    good = 0
    for i, entry in enumerate(line):
        if good >= keep:
            return line[i:]
        good += verified(entry)
    return []


def planned_saves(first: int, steps: int, every: int) -> list[int]:
    """The steps after `first` a job saves at by `checkpoint.every` (and its last)."""
    if not every or first >= steps:
        return []
    return sorted({*range((first // every + 1) * every, steps + 1, every), steps})


def checkpoint_root(cfg: Config) -> Path:
    """The job's checkpoint.dir ('' = run.dir/checkpoints)."""
    return Path(cfg.checkpoint.dir or Path(cfg.run.dir) / "checkpoints")


def new_run(cfg: Config) -> str:
    """The flag that starts a new run beside the checkpoints in this job's checkpoint.dir
    (resume=auto finds none in a fresh directory, so nothing else is needed)."""
    flag = "checkpoint.dir" if cfg.checkpoint.dir else "run.dir"
    return f"--{flag}=<another directory>"


def fresh_refusal(root: Path, step: int) -> str:
    """The refusal of a fresh start (resume=none) in a checkpoint.dir holding checkpoints."""
    return (
        f"checkpoint.dir {root} already holds checkpoints of another run (newest: step {step}), "
        "and checkpoint.resume=none starts a new one whose saves (checkpoint.every, or the one "
        "a stop signal makes) would overwrite or mix with them. Nothing was changed. Fix: "
        "--checkpoint.resume=auto to continue that run, or another --run.dir or "
        "--checkpoint.dir for a new one."
    )


def check_dir(cfg: Config) -> None:
    """What a job's checkpoint.dir must not hold, checked before any rank starts (the lock
    holder calls it): links at names a save writes, or another run's checkpoints when this job
    starts fresh (resume=none) and may save."""
    c, root = cfg.checkpoint, checkpoint_root(cfg)
    if not (c.every or c.on_signal):  # this job writes nothing there
        return
    links = planted_links(root)
    if links:
        raise CheckpointError(
            f"{links[0]} is a symbolic link (to {os.readlink(links[0])}) at a name a save "
            "writes: it would write through it. Nothing was changed. Fix: remove the link."
        )
    found = io.list_complete(root)
    if c.resume == "none" and found:
        raise CheckpointError(fresh_refusal(root, found[0][0]))


def alive_at_once(cfg: Config) -> int:
    """How many checkpoints of this job's size checkpoint.dir must hold at the worst moment:
    those kept plus the one being written, less those already there (pruned meanwhile)."""
    c = cfg.checkpoint
    saves = len(planned_saves(0, cfg.train.steps, c.every)) or 1
    there = min(len(io.list_complete(checkpoint_root(cfg))), c.keep)
    return max(1, min(c.keep + 1, saves) - there)


def make_tmp(root: Path, step: int) -> Path:
    """Create the save's temporary directory afresh (rank 0). A leftover of a killed save of
    ours is replaced; anything else there (a symbolic link, a file, foreign files) is refused:
    a save never writes through it."""
    tmp = io.step_dir(root, step).with_suffix(".tmp")
    root.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(tmp):
        if not io.ours_leftover(tmp):
            raise CheckpointError(
                f"{tmp} is in the way of this save and was not written by one (a symbolic "
                "link, a file or foreign files): it is not written through or deleted. Fix: "
                "move it away and run again with --checkpoint.resume=auto."
            )
        io.remove(tmp)
    os.mkdir(tmp)
    return tmp


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of a save's way (`step-N.damaged`): never loaded, never
    deleted."""
    for n in range(1000):
        aside = path.with_name(path.name + ".damaged" + (f".{n}" if n else ""))
        if not os.path.lexists(aside):
            os.rename(path, aside)
            return aside
    raise CheckpointError(f"{path}: too many damaged copies set aside. Fix: remove them.")


def prune(path: Path, index: dict) -> list[str]:
    """Delete one checkpoint: only the files its index lists, and the index first (a crash
    midway never leaves a complete-looking one). Returns the other entries found in it, which
    are left in place with the directory; without any, the directory goes too."""
    listed = {io.INDEX, *index.get("files", {})}
    entries_ = sorted(os.listdir(path))
    foreign = [e for e in entries_ if e not in listed or not _regular(path / e)]
    if not foreign:
        io.remove(path)
        return []
    os.unlink(path / io.INDEX)
    io.fsync_dir(path)
    for name in sorted((listed - {io.INDEX}) & set(entries_)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path / name)
    return foreign


def _regular(path: Path) -> bool:
    return not path.is_symlink() and path.is_file()


def planted_links(root: Path) -> list[Path]:
    """Symbolic links at names a save writes or deletes (`latest.tmp`, `step-N.tmp`,
    `step-N.deleting`): a save would write through them."""
    if not root.is_dir():
        return []
    names = [c for c in root.iterdir() if c.name == io.LATEST + ".tmp" or io.leftover_name(c)]
    return sorted(c for c in names if c.is_symlink())
