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
