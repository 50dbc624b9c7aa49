"""One live job per run.dir and per checkpoint.dir: a second job on the same
directory is refused at once, naming the holder; the lock dies with its process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.training.lock import acquire, release


def _cfg(tmp_path: Path, *extra: str):
    return load_config(None, [f"--run.dir={tmp_path / 'run'}", *extra])


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    first = acquire(_cfg(tmp_path, "--checkpoint.every=5", f"--checkpoint.dir={tmp_path / 'c'}"))
    try:
        with pytest.raises(ConfigError, match=rf"run.dir=.* is in use .*pid {os.getpid()}, since"):
            acquire(_cfg(tmp_path))
        with pytest.raises(ConfigError, match=r"checkpoint.dir=.* is in use"):
            acquire(
                load_config(
                    None,
                    [
                        f"--run.dir={tmp_path / 'other'}",
                        "--checkpoint.every=5",
                        f"--checkpoint.dir={tmp_path / 'c'}",
                    ],
                )
            )
    finally:
        release(first)
    again = acquire(_cfg(tmp_path))  # released: free again
    release(again)


@pytest.mark.slow
def test_a_second_job_on_a_running_jobs_run_dir_stops_before_it_starts(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardwise.cli.main", "train", "--model.n_layers=2"]
    cmd += ["--data.seq_len=32", "--log.progress=off", f"--run.dir={run}"]
    first = subprocess.Popen([*cmd, "--nproc", "2", "--train.steps=100000"], text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.5)
        second = subprocess.run([*cmd, "--nproc", "1", "--train.steps=2"], capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"pid {first.pid}" in second.stderr and "is in use" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    release(acquire(_cfg(tmp_path)))  # the killed job's lock went with it


def test_the_job_layer_locks_before_joining_and_a_second_job_is_refused_unjoined(
    tmp_path, monkeypatch, capsys
):
    """`shardwise train` as rank 0 of a torchrun world (no launcher of ours holds the lock):
    by the time it would join the process group, the job layer holds the run-dir lock, and a
    second job on the same run.dir started then is refused naming this process, before it
    joins. The first job failing there releases the lock."""
    import torch.distributed as dist

    from shardwise.cli.main import main
    from shardwise.training.lock import HELD_ENV
    from test_rank_path import TINY, _torchrun_rank_0

    _torchrun_rank_0(monkeypatch)
    monkeypatch.delenv(HELD_ENV, raising=False)
    argv = ["train", *TINY, f"--run.dir={tmp_path / 'run'}"]
    seen: dict = {}

    def between_validation_and_joining(*args, **kwargs) -> None:
        if "second" in seen:
            raise AssertionError("the second job joined a process group")
        seen["second"] = None
        with pytest.raises(SystemExit) as second:
            main(argv)
        seen["second"] = (second.value.code, capsys.readouterr().err)
        raise AssertionError("the first job joins")

    monkeypatch.setattr(dist, "init_process_group", between_validation_and_joining)
    with pytest.raises(AssertionError, match="the first job joins"):
        main(argv)
    code, err = seen["second"]
    assert code == 2 and f"run.dir={tmp_path / 'run'} is in use" in err, err
    assert f"pid {os.getpid()}, since" in err and "Traceback" not in err
    assert not dist.is_initialized()
    release(acquire(_cfg(tmp_path)))  # released when the first job failed


def test_build_run_takes_no_lock_and_the_job_layer_holds_it_for_the_block(tmp_path, monkeypatch):
    """A run built by `build_run` alone leaves the run dir free; inside `job_here` (one rank,
    no launcher of ours) the directory is held until the block ends."""
    import torch.distributed as dist

    from shardwise.job.prepare import job_here, validate
    from shardwise.training.lock import HELD_ENV
    from shardwise.training.runtime import build_run
    from test_rank_path import TINY

    monkeypatch.delenv(HELD_ENV, raising=False)
    cfg = load_config(None, [*TINY, f"--run.dir={tmp_path / 'run'}"])
    run = build_run(cfg, validate(cfg, 1))
    try:
        release(acquire(cfg))  # free while the run is built and alive
    finally:
        run.close()
        dist.destroy_process_group()
    with job_here(cfg) as derived:
        assert derived.world == 1
        with pytest.raises(ConfigError, match=rf"is in use .*pid {os.getpid()}"):
            acquire(cfg)
    release(acquire(cfg))
