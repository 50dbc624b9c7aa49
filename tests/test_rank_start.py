"""Local ranks fork from a forkserver started for their launch (launchers/rank_start.py).

A forkserver's children inherit the server's environment from when it started, so a server
left by an earlier launch or by the harness would hand the ranks stale variables: each launch
starts its own, and its ranks see the launching process's environment as it is at the launch,
without the variable that marks the server, with the stop signals' usual actions (the server
ignores them), and their exit handlers run. And the server must not outlive the launcher:
ranks whose launcher died (an OOM kill, a SIGKILL) stop, as spawned ranks did, instead of
training on unsupervised."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.launchers.rank_start import SERVER_ENV
from support.chaos import rank_pids
from support.faultjob import job_env

pytestmark = pytest.mark.slow

# a process that has a forkserver running already (started while the variable said
# "earlier"), then launches a 2-rank job the way `shardwise train --nproc 2` does
SCRIPT = """
import os, sys
from multiprocessing import forkserver
os.environ["SHARDWISE_TEST_MARK"] = "earlier"
forkserver.ensure_running()
os.environ["SHARDWISE_TEST_MARK"] = "at the launch"
from support.faultjob import main
sys.exit(main(sys.argv[1:]))
"""
TINY = ["--model.n_layers=1", "--data.seq_len=16", "--train.global_batch=4"]
TINY += ["--log.progress=off", "--log.tensorboard=false", "--run.device=cpu"]


def test_ranks_see_their_launchs_environment_and_the_usual_signal_actions(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, "--train.steps=1", f"--run.dir={run_dir}"]
    cmd = [sys.executable, "-c", SCRIPT, "support.hooks:record_environment", "2", *args]
    proc = subprocess.Popen(cmd, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out.decode()[-3000:]
    seen = [json.loads((run_dir / f"environment-rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["env"]["SHARDWISE_TEST_MARK"] for s in seen] == ["at the launch"] * 2
    assert [s["env"]["RANK"] for s in seen] == ["0", "1"]  # torch elastic's variables still set
    assert not any(SERVER_ENV in s["env"] for s in seen)
    # forked by one server, not spawned by the launcher
    assert seen[0]["ppid"] == seen[1]["ppid"] != proc.pid
    for s in seen:
        usual = {name: "<Handlers.SIG_DFL: 0>" for name in s["signals"]}
        usual["SIGINT"] = repr(signal.default_int_handler)
        assert s["signals"] == usual
    # the forkserver ends its children without Python's shutdown: the rank ran them itself
    assert [(run_dir / f"exited-rank{r}").read_text() for r in (0, 1)] == ["atexit"] * 2


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (an exited one nobody reaped yet is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_stop_when_their_launcher_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, "--train.steps=100000", "--log.every=1", f"--run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "shardwise.cli.main", "train", "--nproc", "2", *args]
    proc = subprocess.Popen(
        cmd,
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline, metrics, ranks = time.monotonic() + 300, run_dir / "metrics.jsonl", []
        while not (metrics.is_file() and metrics.read_text().strip() and len(ranks) == 2):
            assert proc.poll() is None and time.monotonic() < deadline, "no step in time"
            ranks = rank_pids(proc.pid)
            time.sleep(0.05)
        proc.kill()  # the launcher alone, as the OOM killer would
        proc.wait()
        deadline = time.monotonic() + 120  # their SIGINT, then a save (a busy machine is slow)
        while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(pid) for pid in ranks), "ranks outlived their launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever is left of the job's group
            os.killpg(proc.pid, signal.SIGKILL)
