"""One live job per run.dir and per checkpoint.dir.

The job's first process takes an exclusive `flock` on `DIR/.shardwise.lock` and writes who
holds it (host, PID, start time: data/dirlock.py, which `shardwise data prepare` uses too); the
kernel releases it when that process ends, however it ends, so a lock is never stale. A
second job on the same directory is refused at once, naming the holder. The checkpoint.dir a
job saves into is locked as resolved, also when it is the default run.dir/checkpoints, so a
job pointing its checkpoint.dir into another job's run is refused too. Taking a lock proves
the directory writable before any step is lost to it; the lock file is never opened through
a symbolic link, and a file there that a lock did not write is never truncated. The local
launcher takes the locks before it starts any rank and tells its ranks so
(`SHARDWISE_DIRS_LOCKED`); under torchrun or srun, global rank 0 takes them before it joins
the process group (job/prepare.py `job_here`)."""

from __future__ import annotations

from pathlib import Path
from typing import IO

from shardwise.checkpoint.lineage import check_dir, checkpoint_root
from shardwise.config import Config
from shardwise.data.dirlock import lock_dir
from shardwise.errors import ConfigError

HELD_ENV = "SHARDWISE_DIRS_LOCKED"


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
    busy = "two jobs would overwrite each other's metrics and checkpoints"
    return lock_dir(path, f"{key}={path}", "job", busy, f"--{key}", ConfigError)


def release(held: list[IO[str]]) -> None:
    for fh in held:
        fh.close()  # (the kernel drops the flock with the last descriptor)
    held.clear()
