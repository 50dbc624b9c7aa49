"""One live owner per output directory: an exclusive `flock` on `DIR/.shardwise.lock`.

The owner writes who holds the lock (host, PID, start time) into the file; the kernel releases
the lock when that process ends, however it ends (SIGKILL included), so a lock is never stale:
the next owner truncates the dead holder's line and writes its own. A second owner is refused
at once, naming the holder. The lock file is never opened through a symbolic link, and a file
there that a lock did not write is never truncated. A holder may remove its lock file before
it lets go (a refused `data prepare` removes what it wrote): an owner that locked the removed
file sees it is no longer the one in the directory and locks the new one. Jobs lock their
run.dir and checkpoint.dir with it (training/lock.py), `shardwise data prepare` its --out
(data/prepare.py).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import re
import socket
import tempfile
import weakref
from pathlib import Path
from typing import IO

from shardwise.errors import ShardwiseError

LOCK = ".shardwise.lock"  # a name of ours: a user's `.lock` (in $HOME, say) is never touched
_HOLDER = re.compile(r"^(host .*, pid \d+, since \S+\n)?$")  # what a lock file of ours holds
_OPEN = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# the handle of each lock this process took: a forked child inherits their descriptors, and a
# flock lasts while any copy is open (forget_inherited); held weakly, so that a handle dropped
# without closing still closes (and lets its lock go) when collected
_TAKEN: weakref.WeakSet[IO[str]] = weakref.WeakSet()


def flock_or_holder(fh) -> str | None:
    """Take an exclusive lock on open file `fh` without waiting: None when taken; else `fh` is
    closed and the holder it names is returned (host, PID, start time as a lock writes them)."""
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "a process that has not written its name yet"
        fh.close()
        return holder
    return None


_TRIES = 3  # a lock file removed under us is taken anew; it cannot be removed again and again


def _open(path: Path, flag: str, name: str, error: type[ShardwiseError]) -> int:
    """The lock file's descriptor (the directory made, and proved writable, first)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        # the owner writes there: prove it can before any work is spent
        os.rmdir(tempfile.mkdtemp(prefix=".shardwise-writable-", dir=path))
        return os.open(path / LOCK, _OPEN, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(
                f"{path / LOCK} is a symbolic link: a lock is never written through one. "
                f"Fix: remove it, or {flag}=<another directory>."
            ) from None
        raise error(
            f"{name} cannot be written ({exc.strerror or exc}). Fix: {flag}=<a writable directory>."
        ) from None


def _still_there(lock: Path, fd: int) -> bool:
    """Whether the file locked through `fd` is still the one at `lock`: a holder that removes
    its lock file before it lets go (data prepare, refused) leaves a lock on a file no one
    else will ever open."""
    try:
        return os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def lock_dir(
    path: Path, name: str, who: str, busy: str, flag: str, error: type[ShardwiseError]
) -> IO[str]:
    """Lock directory `path` (creating it) for this process; the handle holds the lock until
    closed. Messages say the directory as `name` (`run.dir=/x`), the owner as `who` (job),
    what a second owner would do as `busy`, and `flag` picks another directory; refusals
    raise `error`."""
    for _ in range(_TRIES):
        fd = _open(path, flag, name, error)
        fh = os.fdopen(fd, "r+")
        holder = flock_or_holder(fh)
        if holder is not None:
            raise error(
                f"{name} is in use by another shardwise {who} ({holder}): {busy}. Fix: wait "
                f"for it to end, or give this {who} another {flag}."
            ) from None
        if _still_there(path / LOCK, fd):
            break
        fh.close()  # its holder removed it (a refused prepare, on its way out): lock anew
    else:
        raise error(f"{name} keeps losing its lock file. Fix: {flag}=<another directory>.")
    fh.seek(0)
    if not _HOLDER.match(fh.read(4096)):  # not a lock file of ours: never truncated
        fh.close()
        raise error(
            f"{path / LOCK} holds something a shardwise lock does not write: it is left as it "
            f"is. Fix: move it away, or {flag}=<another directory>."
        )
    fh.seek(0)
    fh.truncate()
    since = datetime.datetime.now().isoformat(timespec="seconds")
    fh.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {since}\n")
    fh.flush()
    _TAKEN.add(fh)
    return fh


def forget_inherited() -> None:
    """In a forked child (a worker pool's initializer): close its copies of the parent's lock
    descriptors, so each lock lasts exactly as long as the parent. A worker that outlives a
    SIGKILLed parent would otherwise hold it and refuse every rerun. Only the descriptor of a
    handle the parent still held open at the fork is closed (a closed one's number may have
    been reused since)."""
    for fh in list(_TAKEN):
        if not fh.closed:
            os.close(fh.fileno())
    _TAKEN.clear()
