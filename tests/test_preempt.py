"""Preemption-safe stop: SIGTERM to `shardwise train --nproc 2` mid-run ends
it at the next step with a checkpoint of that step and exit status 143, quickly; running the
same command again resumes and ends bitwise equal to a run never interrupted. SIGINT to a
one-process run: the same with 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import io as cio
from shardwise.checkpoint import slices
from support.compare import SMALL

pytestmark = pytest.mark.slow

STEPS = 100
ARGS = [
    *SMALL,
    f"--train.steps={STEPS}",
    f"--checkpoint.every={STEPS}",  # the finished runs save their last step, to compare
    "--log.tensorboard=false",
    "--log.progress=off",
    "--log.every=1000000",
]


def _cmd(run_dir: Path, nproc: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shardwise.cli.main",
        "train",
        "--nproc",
        str(nproc),
        *ARGS,
        f"--run.dir={run_dir}",
        *extra,
    ]


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    index = cio.read_index(ckpt)
    return {k: slices.read_tensor(ckpt, k, index) for k in index["tensors"]}


def _interrupt(
    run_dir: Path, nproc: int, sig: int, extra=(), group: bool = False
) -> tuple[int, int, str]:
    """Start a run, signal it once it has logged 20 steps; (exit status, the steps it had
    logged when signalled, what it printed to stderr). `group`: signal every process of the
    job (its own process group), as Slurm does, instead of the launcher alone."""

    def as_from_a_terminal() -> None:
        # Ctrl-C as from a terminal: a shell's background job inherits SIGINT ignored, and
        # Python then keeps ignoring it (no KeyboardInterrupt), which is not the case under test
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if group:
            os.setsid()

    proc = subprocess.Popen(
        _cmd(run_dir, nproc, *extra),
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    deadline = time.monotonic() + 300  # a hang guard: a busy machine may start slowly
    while _steps_logged(run_dir) < 20:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    logged = _steps_logged(run_dir)  # read after sending: the stop can only come later
    _, err = proc.communicate(timeout=300)
    return proc.returncode, logged, err


def _stopped_at(run: Path, err: str, sig: int) -> int:
    """The step the stopped run logged last, checked against its message and checkpoint."""
    assert f"stopped by {signal.Signals(sig).name} after step" in err, err
    assert "Traceback" not in err, err
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert 20 <= last < STEPS
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [f"step-{last:08d}"]
    return last


def test_sigterm_saves_the_step_and_the_rerun_ends_bitwise_equal(tmp_path):
    """SIGTERM to every process of a 2-rank job, as Slurm's requeue sends it: the launcher
    waits for its ranks to save the step (the server they fork from outlives the signal), and
    the rerun ends bitwise equal to the uninterrupted run."""
    straight = subprocess.run(_cmd(tmp_path / "straight", 2, "--parallel.zero=2"), timeout=300)
    assert straight.returncode == 0
    run = tmp_path / "stopped"
    status, logged, err = _interrupt(run, 2, signal.SIGTERM, ["--parallel.zero=2"], group=True)
    assert status == 143
    last = _stopped_at(run, err, signal.SIGTERM)
    # at the next step boundary: the ranks take the signal in the step's one reduction
    # (training/loop._record), so the stop comes with the step in flight when it was sent, or
    # with the next one when the step in flight had passed its reduction but not yet logged.
    # Counted in steps, not seconds: a busy machine slows the steps and the exit alike (the
    # launcher's and ranks' shutdown, 0.5 s of CPU, took 3-21 s at load 15), not the step the
    # run stops at.
    assert last <= logged + 2, (logged, last)
    assert subprocess.run(_cmd(run, 2, "--parallel.zero=2"), timeout=300).returncode == 0
    whole, resumed = _final_tensors(tmp_path / "straight"), _final_tensors(run)
    assert whole.keys() == resumed.keys()
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGUSR1, 138)])
def test_sigint_or_sigusr1_to_one_process_saves_and_exits_128_plus_it(tmp_path, sig, status):
    """Ctrl-C, and SIGUSR1 (what schedulers send as an early warning, Slurm --signal=USR1)."""
    code, _, err = _interrupt(tmp_path / "run", 1, sig)
    assert code == status
    _stopped_at(tmp_path / "run", err, sig)


def test_on_signal_off_keeps_the_default_behaviour(tmp_path):
    # (far more steps than the signal needs: a busy machine may let 80 steps pass before the
    # watcher sends it, and a finished run has nothing to interrupt)
    status, _, err = _interrupt(
        tmp_path / "off", 1, signal.SIGINT, ["--checkpoint.on_signal=false", "--train.steps=100000"]
    )
    assert status == 130 and "stopped by" not in err  # KeyboardInterrupt: nothing saved
    assert not list((tmp_path / "off").glob("checkpoints/step-*"))


def test_a_save_slower_than_half_the_grace_period_warns(tmp_path, monkeypatch, capsys):
    """The launchers tell the job its grace period (Slurm --signal, the pod's
    terminationGracePeriodSeconds); a save that would not fit in half of it says so."""
    from shardwise.checkpoint.manager import GRACE_ENV
    from shardwise.launchers.harness import run_here
    from support.compare import case

    monkeypatch.setenv(GRACE_ENV, "0.000001")
    run_here(case("--train.steps=2", "--checkpoint.every=2"), str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert "saving step 2 took" in err and "--checkpoint.async=true" in err, err


# Garbage that only a collection frees (a reference cycle, the collector off), which says when
# it is freed: an exit-time collection runs after every atexit handler
CYCLE = """import atexit, gc, os
exiting = []
atexit.register(exiting.append, True)  # registered first: runs after every other handler
class Cycle:
    def __del__(self, os=os, exiting=exiting):
        os.write(1, b"collected at exit" if exiting else b"collected early")
gc.disable()
garbage = Cycle()
garbage.me = garbage
del garbage
"""
ENDINGS = {  # how the process ends; True: Python's exit-time collections still run
    "plain": ("", True),
    "skip": (
        "from shardwise.launchers.process_exit import skip_exit_collection\n"
        "skip_exit_collection()\n",
        False,
    ),
    "cli": ("from shardwise.cli.main import main\nmain(['--help'])\n", False),
    "rank": (  # what torch elastic runs in each rank process (the training itself left out)
        "from shardwise.launchers import local\n"
        "local.train_here = lambda *args: None\n"
        "local.rank_process_main({})\n",
        False,
    ),
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_job_processes_end_without_the_exit_time_collections(ending):
    """The launcher (the CLI) and every rank process it starts end without Python's exit-time
    full collections of all they imported (launchers/process_exit.py): at load 16 those were
    most of the 13 s from a SIGTERM to the launcher's exit, after a 0.2 s save. Checked by
    what the collections do, not by a time: they would free garbage that only a collection
    frees; a plain process shows that they do."""
    code, collected = ENDINGS[ending]
    out = subprocess.run(
        [sys.executable, "-c", CYCLE + code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "collected early" not in out.stdout  # (else the exit would have nothing to show)
    assert ("collected at exit" in out.stdout) is collected, (out.stdout[-500:], out.stderr)


def test_a_signal_during_the_last_save_stops_at_once(tmp_path):
    """Ctrl-C while the final checkpoint is being written: every rank finished its steps and
    the launcher is stopping too; the ranks must say so and exit, not wait for the launcher
    to collect their results (torch elastic's agent does not while it shuts down: it waited
    out its 120 s grace before this was handled)."""
    import os
    import random

    from support.chaos import run_and_kill

    steps = 6
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for attempt in range(3):  # the save lasts milliseconds: a watcher can miss it, then retry
        run = tmp_path / f"run{attempt}"
        cmd = _cmd(run, 2, f"--train.steps={steps}", "--checkpoint.every=2")
        result = run_and_kill(
            cmd, env, run, run / "checkpoints", "save", steps, random.Random(0),
            timeout=240, sig=signal.SIGINT,
        )  # fmt: skip
        if result.killed_pid is not None:
            break
    assert result.killed_pid is not None, "the final save was never caught in 3 runs"
    assert result.returncode == 130, result.output[-2000:]
    # from Ctrl-C to the end: seconds, not the agent's 120 s grace (timed from the signal, so
    # a slow start on a busy machine does not count)
    assert result.exit_s < 60, result.exit_s
    assert cio.latest(run / "checkpoints").name == f"step-{steps:08d}"
