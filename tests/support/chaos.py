"""Fault injection from outside: run `shardwise train` in a subprocess and SIGKILL one of its
ranks (or SIGTERM / SIGINT the job) at a chosen moment (after some step, or while a checkpoint
is being written). Used by
the restart test and benchmarks/fault_soak.py; nothing in the engine knows about it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def _children(pid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of each live child of `pid`."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                out.append((int(child), Path(f"/proc/{child}/cmdline").read_bytes()))
            except OSError:
                continue
    return out


def rank_pids(launcher_pid: int) -> list[int]:
    """The rank processes torch elastic started under `launcher_pid`: the children of the
    forkserver it started for them (or, where ranks are spawned, its spawned children)."""
    out = []
    for pid, cmdline in _children(launcher_pid):
        if b"forkserver import main" in cmdline:
            out += [child for child, _ in _children(pid)]
        elif b"spawn_main" in cmdline:
            out.append(pid)
    return sorted(out)


@dataclass
class KillResult:
    returncode: int
    output: str
    killed_pid: int | None  # None: the run ended before the kill point was reached
    killed_at: str  # what the killer saw when it fired
    exit_s: float = 0.0  # seconds from the signal to the run's end (0: never signalled)


def _reached(when: str, at: int, metrics: Path, ckpt_dir: Path) -> str | None:
    """A description of the moment if the kill point is reached now, else None."""
    if when == "step":
        try:
            steps = len(metrics.read_text().splitlines())
        except OSError:
            return None
        return f"after {steps} logged step(s)" if steps >= at else None
    try:  # when == "save": a save of step >= at is being written
        saving = [
            c.name for c in ckpt_dir.iterdir() if c.name.startswith("step-") and c.suffix == ".tmp"
        ]
    except OSError:
        return None
    due = [n for n in saving if int(n[len("step-") : -len(".tmp")]) >= at]
    return f"while writing {due[0]}" if due else None


def run_and_kill(
    cmd: list[str],
    env: dict[str, str],
    run_dir: Path,
    ckpt_dir: Path,
    when: str,
    at: int,
    rng: random.Random,
    timeout: float = 600,
    sig: int = signal.SIGKILL,
) -> KillResult:
    """Run `cmd`; when `when`='step' and `at` steps are logged, or `when`='save' and the save
    of a step >= `at` has begun, send `sig` (SIGKILL: to one rank chosen by `rng`; SIGTERM: to
    the launcher, as Kubernetes or `kill` would; SIGINT: to the whole process group, as Ctrl-C
    does); wait for the end."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so a timeout can stop every rank
    )
    metrics = run_dir / "metrics.jsonl"
    killed, seen, fired = None, "", 0.0
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and killed is None and time.monotonic() < deadline:
            moment = _reached(when, at, metrics, ckpt_dir)
            pids = rank_pids(proc.pid) if moment else []
            if pids:
                seen, fired = moment, time.monotonic()
                if sig == signal.SIGKILL:
                    killed = rng.choice(pids)
                    os.kill(killed, sig)
                elif sig == signal.SIGINT:
                    killed = proc.pid
                    os.killpg(proc.pid, sig)
                else:
                    killed = proc.pid
                    os.kill(proc.pid, sig)
            time.sleep(0.002)
        output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException as exc:  # a timeout (or a failing watcher) must not leave ranks behind
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[stopped: {type(exc).__name__}: {exc}]"
    exit_s = time.monotonic() - fired if fired else 0.0
    return KillResult(proc.returncode, output, killed, seen, exit_s)
