"""One live job per run.dir and per checkpoint.dir (issue 26, item 3).

The job's first process takes an exclusive `flock` on `DIR/.lock` and writes who holds it
(host, PID, start time); the kernel releases it when that process ends, however it ends, so a
lock is never stale. A second job on the same directory is refused at once, naming the holder.
The local launcher takes the locks before it starts any rank and tells its ranks so
(`SHARDWISE_DIRS_LOCKED`); under torchrun or srun, global rank 0 takes them."""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from shardwise.config import Config
from shardwise.errors import ConfigError

HELD_ENV = "SHARDWISE_DIRS_LOCKED"


def _dirs(cfg: Config) -> list[tuple[str, Path]]:
    run = Path(cfg.run.dir)
    out = [("run.dir", run)]
    if cfg.checkpoint.every and cfg.checkpoint.dir:  # a checkpoint.dir of its own, written to
        ckpt = Path(cfg.checkpoint.dir)
        if ckpt.resolve() != run.resolve():
            out.append(("checkpoint.dir", ckpt))
    return out


def acquire(cfg: Config) -> list[IO[str]]:
    """Lock the job's directories (creating them); the handles hold the locks until closed."""
    held: list[IO[str]] = []
    try:
        for key, path in _dirs(cfg):
            held.append(_lock(key, path))
    except BaseException:
        release(held)
        raise
    return held


def _lock(key: str, path: Path) -> IO[str]:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fh = open(path / ".lock", "a+")  # noqa: SIM115 - held open while the job runs
    except OSError as exc:
        raise ConfigError(
            f"{key}={path} cannot be written: {exc}. Fix: --{key}=<a writable directory>."
        ) from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "a process that has not written its name yet"
        fh.close()
        raise ConfigError(
            f"{key}={path} is in use by another shardwise job ({holder}): two jobs would "
            f"overwrite each other's metrics and checkpoints. Fix: wait for it to end, or give "
            f"this job another --{key}."
        ) from None
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
