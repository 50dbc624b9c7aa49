"""One live job per run.dir and per checkpoint.dir.

The job's first process takes an exclusive `flock` on `DIR/.shardwise.lock` and writes who
holds it (host, PID, start time); the kernel releases it when that process ends, however it
ends, so a lock is never stale. A second job on the same directory is refused at once, naming
the holder. The checkpoint.dir a job saves into is locked as resolved, also when it is the
default run.dir/checkpoints, so a job pointing its checkpoint.dir into another job's run is
refused too. Taking a lock proves the directory writable before any step is lost to it; the
lock file is never opened through a symbolic link, and a file there that a lock did not write
is never truncated. The local launcher takes the locks before it starts any rank and tells
its ranks so (`SHARDWISE_DIRS_LOCKED`); under torchrun or srun, global rank 0 takes them."""

from __future__ import annotations

import datetime
import errno
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import IO

from shardwise.checkpoint.io import flock_or_holder
from shardwise.checkpoint.lineage import check_dir, checkpoint_root
from shardwise.config import Config
from shardwise.errors import ConfigError

HELD_ENV = "SHARDWISE_DIRS_LOCKED"
LOCK = ".shardwise.lock"  # a name of ours: a user's `.lock` (in $HOME, say) is never touched
_HOLDER = re.compile(r"^(host .*, pid \d+, since \S+\n)?$")  # what a lock file of ours holds
_OPEN = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _dirs(cfg: Config) -> list[tuple[str, Path]]:
    run = Path(cfg.run.dir)
    out = [("run.dir", run)]
    c = cfg.checkpoint
    if c.every or c.on_signal:  # the job may save: its checkpoint.dir, default or not
        ckpt = checkpoint_root(cfg)
        if ckpt.resolve() != run.resolve():
            out.append(("checkpoint.dir", ckpt))
    return out


def acquire(cfg: Config) -> list[IO[str]]:
    """Lock the job's directories (creating them), then refuse a checkpoint.dir its saves
    could not use safely (`lineage.check_dir`); the handles hold the locks until closed."""
    held: list[IO[str]] = []
    try:
        for key, path in _dirs(cfg):
            held.append(_lock(key, path))
        check_dir(cfg)  # (under the lock: no other job changes it meanwhile)
    except BaseException:
        release(held)
        raise
    return held


def _lock(key: str, path: Path) -> IO[str]:
    try:
        path.mkdir(parents=True, exist_ok=True)
        # a save creates directories there: prove it can before any step is spent
        os.rmdir(tempfile.mkdtemp(prefix=".shardwise-writable-", dir=path))
        fd = os.open(path / LOCK, _OPEN, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{path / LOCK} is a symbolic link: a lock is never written through one. "
                f"Fix: remove it, or --{key}=<another directory>."
            ) from None
        raise ConfigError(
            f"{key}={path} cannot be written ({exc.strerror or exc}). Fix: --{key}=<a writable "
            "directory>."
        ) from None
    fh = os.fdopen(fd, "r+")
    holder = flock_or_holder(fh)
    if holder is not None:
        raise ConfigError(
            f"{key}={path} is in use by another shardwise job ({holder}): two jobs would "
            f"overwrite each other's metrics and checkpoints. Fix: wait for it to end, or give "
            f"this job another --{key}."
        ) from None
    fh.seek(0)
    if not _HOLDER.match(fh.read(4096)):  # not a lock file of ours: never truncated
        fh.close()
        raise ConfigError(
            f"{path / LOCK} holds something a shardwise lock does not write: it is left as it "
            f"is. Fix: move it away, or --{key}=<another directory>."
        )
    fh.seek(0)
    fh.truncate()
    since = datetime.datetime.now().isoformat(timespec="seconds")
    fh.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {since}\n")
    fh.flush()
    return fh


def release(held: list[IO[str]]) -> None:
    for fh in held:
        fh.close()  # (the kernel drops the flock with the last descriptor)
    held.clear()
