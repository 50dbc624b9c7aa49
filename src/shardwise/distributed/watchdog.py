"""Hang diagnosis: a watchdog thread per rank that turns a stuck collective into one report.

Why a thread beside the collectives: a rank that skipped a collective, or sleeps, or froze,
leaves its peers blocked inside gloo/NCCL, and what the blocked call does after the
timeout depends on the backend (gloo raises on the waiting ranks; the rank that went
elsewhere may block on another group, or never call anything again). The watchdog does not
rely on it. Every `poll_s` it

* publishes a heartbeat (a counter, what the rank is blocked in, the tail of its trace) to
  the job's rendezvous store (the TCPStore torchrun / torch elastic / our launcher already
  run: no protocol of our own);
* checks whether its own rank has been blocked in one collective longer than
  `parallel.timeout_s`, whether a collective failed (the comm layer tells it), and whether
  the next rank's heartbeat has stopped for that long (a frozen or dead process);
* checks whether any rank raised the alarm.

On the alarm every rank that can still answer publishes its trace (and its main thread's
stack) and writes it to `run.dir/hang/rank-NNNNN.trace`; the rank that raised the alarm
first waits up to `grace_s` for the others, composes one report (shardwise.distributed.hangreport),
writes `run.dir/hang_report.txt`, and every rank exits with status 3. The job so stops
within timeout + poll + grace seconds, never hangs.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import sys
import threading
import time
import weakref
from dataclasses import astuple
from pathlib import Path
from typing import ClassVar

import torch.distributed as dist

from shardwise.distributed import hangreport
from shardwise.distributed.comm import Comm, TraceEntry

EXIT_HANG = 3  # the exit status of every rank of a job stopped by the watchdog
REPORT = "hang_report.txt"
LOCAL_LAUNCH_ENV = "SHARDWISE_LOCAL_LAUNCH"  # set by our launcher, which prints the report


def _describe(e: TraceEntry) -> str:
    return hangreport._describe(list(astuple(e)))


class Watchdog:
    """Watches one rank's collectives (see the module docstring); `start()` / `stop()`."""

    _instances: ClassVar[
        dict[str, int]
    ] = {}  # per (restart, run dir): keys stay apart between runs

    def __init__(
        self,
        comm: Comm,
        store: dist.Store,
        timeout_s: float,
        run_dir: str,
        poll_s: float | None = None,
        grace_s: float = 5.0,
    ) -> None:
        self.comm, self.store = comm, store
        self.rank, self.world = comm.topo.rank, comm.topo.world
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.poll_s = poll_s or min(1.0, max(0.1, timeout_s / 10))
        self.run_dir = Path(run_dir)
        run_key = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{run_dir}"
        Watchdog._instances[run_key] = Watchdog._instances.get(run_key, 0) + 1
        self.ns = f"shardwise/watchdog/{run_key}/{Watchdog._instances[run_key]}"
        self.state = "running"
        self._main = threading.get_ident()  # the training thread
        self._had_group = dist.is_initialized()
        self._stop = threading.Event()
        self._failure: str | None = None
        self._release = threading.Event()  # lets a failed collective's exception through
        self._beats = 0
        self._peer = (self.rank + 1) % self.world
        self._peer_seen: tuple[int, float] | None = None
        self.thread = threading.Thread(target=self._run, name="shardwise-watchdog", daemon=True)

    # -- life cycle -----------------------------------------------------------------------------
    def start(self) -> Watchdog:
        self._beat()
        self.thread.start()
        _LIVE.add(self)
        return self

    def stop(self, error: BaseException | None = None) -> None:
        """The rank leaves training (finished, or failed with `error`): stop watching, and
        tell the peers that silence from now on is not a hang. A failed rank's own error is
        the diagnosis of whatever its peers then wait for (see `_run`)."""
        self._stop.set()
        self._release.set()
        self.thread.join(timeout=10 * self.poll_s)
        if not self.thread.is_alive():
            first = str(error).strip().splitlines()[0][:200] if error and str(error).strip() else ""
            self.state = "finished" if error is None else f"failed: {type(error).__name__}: {first}"
            with contextlib.suppress(Exception):  # the store may be gone with the job
                self._beat()

    def collective_failed(self, entry: TraceEntry, exc: Exception) -> None:
        """Called by the comm layer when a collective raised (gloo's own timeout, a peer that
        went away). Raises the alarm and waits for the watchdog to stop the job; returns
        (the caller re-raises) only if the watchdog is not running or cannot finish."""
        if not self.thread.is_alive():
            return
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        self._failure = f"rank {self.rank}: {_describe(entry)} failed: {first}"
        self._release.wait(timeout=self.timeout_s + self.grace_s + 10 * self.poll_s + 10)
        self._release.clear()

    # -- the loop -------------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return "/".join([self.ns, *map(str, parts)])

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                if self._had_group and not dist.is_initialized():
                    return  # the job ended without stopping us (a run never closed)
                self._beat()
                reason = self._failure or self._timed_out() or self._peer_silent()
                if self.store.check([self._key("alarm")]):
                    self._stop_job(None)
                elif reason is not None and not self._explained_by_failed_peer():
                    self._stop_job(reason)
        except Exception as exc:  # the store went away: nothing left to coordinate with
            print(f"shardwise watchdog (rank {self.rank}) stopped: {exc}", file=sys.stderr)
            self._orphaned(exc)

    def _orphaned(self, exc: Exception) -> None:
        """The store is gone with the process that held it (rank 0 or the agent): no peer
        can be asked any more. A collective this rank is blocked in has then lost a peer
        (gloo may never notice): once it has waited `grace_s`, end the process, instead of
        holding the restart until the launcher's SIGKILL (30 s after its SIGTERM, which the
        blocked main thread cannot act on) or the collective's own timeout."""
        while not self._stop.wait(self.poll_s):
            blocked = self.comm.blocked
            if blocked is None or time.monotonic() - blocked[1] <= self.grace_s:
                continue
            waited = time.monotonic() - blocked[1]
            print(
                f"shardwise watchdog (rank {self.rank}): the job's store is gone ({exc}) and "
                f"this rank has waited {waited:.1f} s in {_describe(blocked[0])}: a peer "
                "has stopped; exiting (the last complete checkpoint stays valid)",
                file=sys.stderr,
            )
            self._exit()

    def _explained_by_failed_peer(self) -> bool:
        """A peer that left training with an error explains why this rank waits: its error is
        the diagnosis, so a failed collective raises here too (and the launcher stops the job
        as it does for any failing rank). A wait that has not failed after timeout + grace
        is stopped as a hang all the same: never an endless wait."""
        failed = False
        for r in range(self.world):
            key = self._key("hb", r)
            if r != self.rank and self.store.check([key]):
                failed |= json.loads(self.store.get(key))["state"].startswith("failed")
        blocked = self.comm.blocked
        overdue = blocked is not None and (
            time.monotonic() - blocked[1] > self.timeout_s + self.grace_s
        )
        if failed and self._failure is not None:
            self._failure = None
            self._release.set()
        return failed and not overdue

    def _timed_out(self) -> str | None:
        blocked = self.comm.blocked
        if blocked is None:
            return None
        entry, since = blocked
        waited = time.monotonic() - since
        if waited <= self.timeout_s:
            return None
        return f"rank {self.rank} waited {waited:.1f} s in {_describe(entry)}"

    def _peer_silent(self) -> str | None:
        key = self._key("hb", self._peer)
        if self._peer == self.rank or not self.store.check([key]):
            return None
        beat = json.loads(self.store.get(key))
        now = time.monotonic()
        if beat["state"] != "running":
            self._peer_seen = None
            return None
        if self._peer_seen is None or beat["beat"] != self._peer_seen[0]:
            self._peer_seen = (beat["beat"], now)
            return None
        silent = now - self._peer_seen[1]
        if silent <= self.timeout_s:
            return None
        return f"rank {self._peer} sent no heartbeat for {silent:.1f} s"

    # -- what a rank publishes ------------------------------------------------------------------
    def _snapshot(self, tail: int) -> dict:
        topo = self.comm.topo
        for _ in range(3):  # the training thread may append while we copy
            try:
                trace = [list(astuple(e)) for e in list(self.comm.trace)[-tail:]]
                break
            except RuntimeError:
                continue
        else:
            trace = []
        blocked = self.comm.blocked
        frame = sys._current_frames().get(self._main)
        stack = []
        while frame is not None and len(stack) < 8:
            code = frame.f_code
            stack.append(
                f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} in {code.co_name}"
            )
            frame = frame.f_back
        return {
            "rank": self.rank,
            "coords": {d: topo.coord(d) for d in hangreport.DIMS},
            "sizes": {d: topo.size(d) for d in hangreport.DIMS},
            "trace": trace,
            "dim_seq": dict(self.comm.dim_seq),
            "blocked": None
            if blocked is None
            else {"entry": list(astuple(blocked[0])), "for_s": time.monotonic() - blocked[1]},
            "stack": stack,
            "state": self.state,
            "t": time.time(),
        }

    def _beat(self) -> None:
        self._beats += 1
        snap = self._snapshot(tail=32)
        snap["beat"] = self._beats
        self.store.set(self._key("hb", self.rank), json.dumps(snap))

    # -- stopping the job -----------------------------------------------------------------------
    def _stop_job(self, reason: str | None) -> None:
        alarm = self._key("alarm")
        if reason is not None:
            mine = json.dumps({"rank": self.rank, "reason": reason})
            self.store.compare_set(alarm, "", mine)
        first = json.loads(self.store.get(alarm))
        self.store.set(self._key("dump", self.rank), json.dumps(self._snapshot(tail=512)))
        self._write_trace()
        if first["rank"] == self.rank:
            self._report(first["reason"])
        else:  # the reporter's report, or give up after a bound: never hang here either
            deadline = datetime.timedelta(seconds=self.grace_s + 10)
            with contextlib.suppress(Exception):
                self.store.wait([self._key("report")], deadline)
        self._exit()

    def _exit(self) -> None:
        """End the process now, whatever the training thread is doing."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_HANG)

    def _write_trace(self) -> None:
        out = self.run_dir / "hang" / f"rank-{self.rank:05d}.trace"
        out.parent.mkdir(parents=True, exist_ok=True)
        lines = [_describe(e) + f"  [collective {e.seq}]" for e in list(self.comm.trace)]
        out.write_text("\n".join(lines) + "\n")

    def _report(self, reason: str) -> None:
        keys = {r: self._key("dump", r) for r in range(self.world)}
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(0.1)
        dumps, beats = {}, {}
        for r, key in keys.items():
            if self.store.check([key]):
                dumps[r] = json.loads(self.store.get(key))
            elif self.store.check([self._key("hb", r)]):
                beats[r] = json.loads(self.store.get(self._key("hb", r)))
                beats[r]["age_s"] = time.time() - beats[r]["t"]
        sizes = {d: self.comm.topo.size(d) for d in hangreport.DIMS}
        text = hangreport.compose(self.world, sizes, self.timeout_s, reason, dumps, beats)
        text += f"\ntraces of every rank that answered: {self.run_dir / 'hang'}/rank-*.trace\n"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / REPORT).write_text(text)
        self.store.set(self._key("report"), text)
        if os.environ.get(LOCAL_LAUNCH_ENV) != "1":  # under torchrun/srun: print it ourselves
            print(text, file=sys.stderr, flush=True)


_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """A run that was never closed must not leave its thread inside a store call while the
    interpreter shuts down (C++ would then abort the process)."""
    for watchdog in list(_LIVE):
        watchdog._stop.set()
        watchdog.thread.join(timeout=2 * watchdog.poll_s + 1)


def start_watchdog(comm: Comm, timeout_s: float, run_dir: str) -> Watchdog | None:
    """A started watchdog attached to `comm`, or None for one rank (nothing can hang) or
    without a rendezvous store (MASTER_ADDR/MASTER_PORT) to publish to."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if comm.topo.world == 1 or not host or not port:
        return None
    try:
        store = dist.TCPStore(
            host,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError) as exc:  # training can go on; say what is missing
        print(
            f"warning: hang diagnosis is off: the rendezvous store {host}:{port} is not "
            f"reachable ({exc}); a stuck collective fails after parallel.timeout_s without "
            "a report.",
            file=sys.stderr,
        )
        return None
    comm.watchdog = Watchdog(comm, store, timeout_s, run_dir).start()
    return comm.watchdog
