"""Preemption-safe stop (`checkpoint.on_signal`): SIGTERM, SIGINT or SIGUSR1 ends the job at the
next step boundary with a checkpoint, instead of losing everything since the last one.

A signal only sets a flag here; the training loop folds it into the per-step reduction every
rank already makes (training/loop.py), so all ranks see a signal that reached any of them in
the same step, finish it, save, log, and exit 128 + the signal number (143 for SIGTERM, 130
for SIGINT, 138 for SIGUSR1: what Slurm's requeue and Kubernetes' restart policies expect of
a job that was told to stop). A second signal aborts at once (the atomic save leaves the last
complete checkpoint valid) — unless it comes within 2 s of the first: Ctrl-C reaches every
process of the terminal's group and torch elastic's agent forwards it again, which is one
request, not two.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
SAME_REQUEST_S = 2.0


class Preempted(Exception):
    """The job stopped on a signal; `code` is the process's exit status. `saved`: it saved a
    checkpoint of `step` at `where` (False: it stopped before saving any; `where` is then the
    newest earlier checkpoint, or None)."""

    def __init__(
        self,
        signum: int,
        step: int | None,
        where: str | None,
        saved: bool = True,
        metrics: str | None = None,
    ) -> None:
        self.signum, self.step, self.code, self.saved = signum, step, 128 + signum, saved
        name = signal.Signals(signum).name
        logged = f"; metrics in {metrics}" if metrics else ""
        if saved:
            after = f" after step {step}" if step is not None else ""
            text = (
                f"stopped by {name}{after}: checkpoint saved in {where}{logged}. Fix: run the "
                "same command again with --checkpoint.resume=auto (the default) to resume from "
                "it."
            )
        elif where:
            text = (
                f"stopped by {name} before this run saved a checkpoint{logged}. The same "
                f"command resumes from the newest earlier one, {where} (step {step})."
            )
        else:
            text = (
                f"stopped by {name} before any checkpoint was saved: nothing to resume{logged}. "
                "Fix: run the same command again to start over."
            )
        super().__init__(text)


def preempt_code(code: int) -> int | None:
    """The signal a rank's exit status says it stopped on after saving (None: not that)."""
    return code - 128 if code - 128 in SIGNALS else None


class StopRequest:
    """The first stop signal received by this process (0: none), while installed."""

    def __init__(self, checkpoints: Path | None = None) -> None:
        self.checkpoints = checkpoints  # checkpoint.dir: what an abort says is left there
        self.signum = 0
        self._at = 0.0
        self._old: dict[int, object] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers live in the main thread only
        for sig in SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._at = signum, now
            return
        if now - self._at > SAME_REQUEST_S:  # a second request: abort without saving
            print(
                f"shardwise: second {signal.Signals(signum).name}: aborting at once without "
                f"saving; {self._left()}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)

    def _left(self) -> str:
        """What an abort leaves: the newest complete checkpoint (an unfinished save is never
        loaded), or that there is none."""
        from shardwise.checkpoint.io import latest  # (loaded by then: fit's Checkpointer)

        newest = latest(self.checkpoints) if self.checkpoints is not None else None
        if newest is None:
            return "no checkpoint was saved"
        return f"the newest complete checkpoint, {newest}, stays valid"

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
