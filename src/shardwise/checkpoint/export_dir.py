"""Where an export is written: OUT is replaced whole, never mixed, never someone else's.

An export is written into a temporary sibling folder `.OUT.shardwise-export.tmp-XXXX`, marked
with `MARKER` (the checkpoint it came from and every file it holds) and renamed into place at
the end; an earlier export of ours at OUT is moved aside first and deleted after. A reader of
OUT sees the old export or the new one, never shards of two checkpoints, and an export that
fails or is stopped (SIGTERM, SIGINT) removes its temporary folder and leaves OUT as it was.

OUT must be missing, empty, an earlier export of ours (the files its marker lists, nothing
else), or `overwrite` given (OUT and everything in it is replaced); it may neither be inside
the run, checkpoint or base model being exported nor hold them. One export at a time per OUT:
an exclusive `flock` on the sibling `.OUT.shardwise-export.lock`, deleted when done.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from shardwise.data.dirlock import flock_or_holder
from shardwise.errors import ShardwiseError

MARKER = ".shardwise-export.json"
_STOP = (signal.SIGTERM, signal.SIGINT)


class ExportStopped(ShardwiseError):
    """A stop signal ended the export; `code` is the exit status (128 + the signal)."""

    def __init__(self, signum: int, out: Path) -> None:
        self.code = 128 + signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name}: nothing was written, {out} is as it was. "
            "Fix: run the export again."
        )


def _sibling(out: Path, what: str) -> Path:
    return out.parent / f".{out.name}.shardwise-export.{what}"


def _refuse_overlap(out: Path, protected: dict[str, Path], fmt: str = "export") -> None:
    """OUT may not be, lie inside or hold what the export reads (the run, its checkpoints)."""
    where = out.resolve()
    holders = {w: p.resolve() for w, p in protected.items()}
    holders = {w: p for w, p in holders.items() if where == p or p in where.parents}
    if holders:
        what = next(iter(holders))
        # the suggestion sits beside the outermost of them: outside every protected folder
        top = min(holders.values(), key=lambda p: len(p.parts))
        own = " (its config.json)" if what == "the run directory" else ""
        raise ShardwiseError(
            f"OUT={out} is inside {what} {protected[what]}: the export would overwrite or mix "
            f"with the run's own files{own}. Fix: an OUT outside it, e.g. {top}-{fmt}."
        )
    for what, path in protected.items():
        if where in path.resolve().parents:
            raise ShardwiseError(
                f"OUT={out} holds {what} {path}: replacing OUT would delete it. Fix: an OUT "
                "beside it, e.g. a new folder."
            )


def _ours(out: Path) -> tuple[bool, list[str]]:
    """(whether OUT is an earlier export of ours, the entries in it we did not write)."""
    names = sorted(p.name for p in out.iterdir())
    try:
        listed = set(json.loads((out / MARKER).read_text())["files"]) | {MARKER}
    except (OSError, ValueError, KeyError, TypeError):
        return False, names
    return True, [n for n in names if n not in listed or (out / n).is_dir()]


def _check_replaceable(out: Path, overwrite: bool) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ShardwiseError(
            f"OUT={out} is a file or a link, not a folder. Fix: name a new or empty folder."
        )
    if overwrite or not out.exists():
        return
    ours, foreign = _ours(out)
    if not foreign:  # empty, or exactly an earlier export of ours: replaced whole
        return
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    what = "an earlier export that also holds files it did not write" if ours else "not empty"
    raise ShardwiseError(
        f"OUT={out} is {what} ({shown}); exporting there would replace or mix with them. Fix: "
        f"a new or empty OUT, or --overwrite to replace {out} and everything in it."
    )


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold the OUT's export lock; a second export to OUT is refused, naming the holder."""
    path = _sibling(out, "lock")
    while True:
        fh = open(path, "a+")  # noqa: SIM115 - held open while exporting
        holder = flock_or_holder(fh)
        if holder is not None:
            raise ShardwiseError(
                f"another export is writing OUT={out} ({holder}). Fix: wait for it to end, or "
                "export to another folder."
            ) from None
        try:  # the previous holder may have deleted the file between our open and our lock
            same = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        fh.close()
    since = datetime.datetime.now().isoformat(timespec="seconds")
    fh.write(f"pid {os.getpid()}, since {since}\n")
    fh.flush()
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # before the lock goes: a waiter then sees another inode
        fh.close()


def _recover(out: Path) -> None:
    """Tidy what a killed export of ours left beside OUT (we hold OUT's lock: none runs)."""
    for old in sorted(out.parent.glob(f".{out.name}.shardwise-export.old-*")):
        if not out.exists():  # killed between its two renames: the earlier export comes back
            os.rename(old, out)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in out.parent.glob(f".{out.name}.shardwise-export.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _swap(tmp: Path, out: Path) -> None:
    """Put the finished export at OUT; the earlier one is deleted once the new one is there."""
    old = _sibling(out, f"old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old.exists():
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _make_parents(out: Path) -> list[Path]:
    """Create OUT's missing parent folders; returns them (to remove on failure)."""
    made = [p for p in reversed(out.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    return made


@contextlib.contextmanager
def _stop_raises(out: Path) -> Iterator[Callable[[], None]]:
    """SIGTERM/SIGINT raise ExportStopped here (only the main thread can catch signals); yields
    the function that gives the signals back their earlier handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def stop(signum, _frame):
        raise ExportStopped(signum, out)

    before = {s: signal.signal(s, stop) for s in _STOP}

    def restore() -> None:
        for s, handler in before.items():
            signal.signal(s, handler)

    try:
        yield restore
    finally:
        restore()


def _finish(tmp: Path, about: dict) -> None:
    """Mark the export as ours, and give it the modes any new file gets (the temporary folder
    and safetensors' files are private to their owner)."""
    files = sorted(p.name for p in tmp.iterdir())
    (tmp / MARKER).write_text(json.dumps({**about, "files": files}, indent=1))
    mask = os.umask(0)
    os.umask(mask)
    for path in tmp.iterdir():
        os.chmod(path, 0o666 & ~mask)
    os.chmod(tmp, 0o777 & ~mask)


@contextlib.contextmanager
def writing(out: str | Path, about: dict, protected: dict[str, Path], overwrite: bool = False):
    """A temporary folder to write an export into; on leaving without error it is marked
    (`about` plus its file names) and replaces OUT, on any failure it is removed."""
    out = Path(os.path.abspath(out))
    _refuse_overlap(out, protected, str(about.get("format") or "export"))
    with _stop_raises(out) as restore:
        made, tmp = [], None
        try:
            made = _make_parents(out)
            with _locked(out):
                _recover(out)
                _check_replaceable(out, overwrite)
                tmp = Path(tempfile.mkdtemp(prefix=_sibling(out, "tmp-").name, dir=out.parent))
                yield tmp
                _finish(tmp, about)
                signal.pthread_sigmask(signal.SIG_BLOCK, _STOP)  # no stop between the renames
                try:
                    _swap(tmp, out)
                finally:  # a stop signal that came meanwhile finds the export done
                    restore()
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP)
        except OSError as exc:
            raise ShardwiseError(
                f"writing the export to {out} failed ({exc}); {out} is as it was. Fix: free "
                "space there (or repair it), or export to another folder."
            ) from None
        finally:
            if tmp is not None:  # ours; gone already when the export succeeded
                shutil.rmtree(tmp, ignore_errors=True)
            for parent in reversed(made):
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only the still-empty folders we created
