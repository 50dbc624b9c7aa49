"""One rank's part of `shardwise profile`: ledgers, blocking waits, a timeline and a trace.

The last `profile.steps` steps of the run are measured: each rank keeps its ledger and every
blocking collective's wait (the straggler analysis matches them across ranks), and the clock's
intervals (the merged timeline). One more step after them runs under torch.profiler, so the
measured ledgers carry no profiler overhead. The measured steps also count their host
syncs by call site (profile/host_syncs.py; `profile.host_syncs`). Every rank writes
`rank<R>.json` (and `trace_rank<R>.json`) into run.dir, then waits for the others at one step
boundary, the same on every rank: capture cannot make ranks disagree on a collective. A trace
that fails to write is reported in the rank's file instead; the job goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

from shardwise.distributed import device as dev
from shardwise.distributed.clock import clock
from shardwise.profile import cpu
from shardwise.profile.host_syncs import HostSyncs
from shardwise.profile.kernels import device_ledger


class _Off:
    active = False

    def step_begins(self, step: int) -> bool:
        return False

    def step_ends(self, step: int, record: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def stop(self) -> None:
        pass


def capture_for(run, start: int):
    """The capture of a `shardwise profile` run (profile.steps > 0), else one that does
    nothing."""
    if not run.cfg.profile.steps:
        return _Off()
    return Capture(run, start)


def trace_name(rank: int) -> str:
    return f"trace_rank{rank}.json"


class Capture:
    active = True

    def __init__(self, run, start: int) -> None:
        cfg = run.cfg
        self.run, self.dir = run, Path(cfg.run.dir)
        # measured: the steps after the warm-up; then one traced step
        self.traced = cfg.train.steps - 1
        self.first = self.traced - cfg.profile.steps
        self.steps: list[dict] = []
        self.events: list[tuple[str, float, float]] = []
        self.sync = 0.0  # perf_counter just after a barrier all ranks left together
        self.traced_ledger: dict | None = None
        self.profiler = None
        self.error: str | None = None
        clock().problem = None  # (process state: a failure of an earlier run is not ours)
        self.step_range = None  # the traced step as a profiler range (`sw:step`)
        self.device_ledger: dict | None = None  # the traced step from its kernels (CUDA)
        self.cpu_mark: tuple | None = None  # CPU counters at the last step boundary
        # host syncs by call site, counted in the measured steps (profile.host_syncs)
        self.syncs = HostSyncs() if cfg.profile.host_syncs else None
        self.counting = False

    def _barrier(self) -> float:
        self.run.comm.all_reduce_world(torch.zeros(1, device=self.run.info.device))
        return time.perf_counter()

    def step_begins(self, step: int) -> bool:
        """Start recording what `step` needs; True when it waited for the other ranks."""
        clk = clock()
        if step == self.traced:
            clk.events = clk.calls = None
            clk.mark_stalls(None)  # (the profiler's own overhead would count as stalls)
            self.profiler = _start_profiler(self.run.info.device)
            clk.annotate(True)  # regions become ranges: which one launched each kernel
            self.step_range = torch.autograd.profiler.record_function("sw:step")
            self.step_range.__enter__()
        if step != self.first:
            return False
        self.sync = self._barrier()  # all ranks leave it together: the timeline's zero
        clk.events, clk.calls = self.events, []
        clk.mark_stalls(dev.stall_marker(self.run.info))  # CUDA: the device's idle per wait
        self.cpu_mark = cpu.snapshot()
        if self.syncs is not None:  # counting until the last measured step ends
            self.syncs.__enter__()
            self.counting = True
        return True

    def step_ends(self, step: int, record: dict) -> None:
        clk = clock()
        if self.first <= step < self.traced:
            comm = {k: record[k] for k in ("comm_bytes", "comm_calls", "comm_wait_s")}
            mark, self.cpu_mark = self.cpu_mark, cpu.snapshot()
            self.steps.append(
                {"step": step + 1, "ledger": record["ledger"], "waits": clk.calls, **comm}
            )
            if mark is not None:  # did the rank get the CPU it was ready to use (cpu.py)
                self.steps[-1]["cpu"] = cpu.between(mark, self.cpu_mark)
            if self.counting:  # from the last step's end to this one's, as the ledger
                self.steps[-1]["host_syncs"] = self.syncs.take()
                if step + 1 == self.traced:
                    self._stop_counting()
            if clk.marker is not None:
                try:  # measuring the device's stalls must not stop the job either
                    self.steps[-1]["device_stall_s"] = clk.take_stalls(dev.stalled_s)
                except Exception as exc:  # (any failure: reported in the rank's file)
                    clk.mark_stalls(None)
                    self.error = f"device stalls not measured: {exc}"
            clk.calls = []
        elif step == self.traced:
            self.traced_ledger = record.get("ledger")
            prof = self.stop()
            try:  # a trace that cannot be written must not stop the job
                trace = _export(prof, self.dir / trace_name(self.run.topo.rank), self.cap)
            except Exception as exc:  # (any failure: reported in the rank's file)
                self.error = f"trace not written: {exc}"
                return
            try:
                self.device_ledger = device_ledger(trace)
            except Exception as exc:  # (a trace it cannot read: the host ledger stays)
                self.error = f"device ledger not built: {exc}"

    @property
    def cap(self) -> int:
        return self.run.cfg.profile.max_events

    def _stop_counting(self) -> None:
        if self.counting:
            self.counting = False
            self.syncs.__exit__(None, None, None)

    def stop(self):
        """Stop recording (idempotent); returns the stopped profiler, if one ran."""
        self._stop_counting()
        clk = clock()
        clk.events = clk.calls = None
        clk.annotate(False)
        clk.mark_stalls(None)
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        prof, self.profiler = self.profiler, None
        if prof is not None:
            with _quiet_stderr():
                prof.stop()
        return prof

    def close(self) -> None:
        """Write this rank's file, then wait until every rank has written its own."""
        topo, rank = self.run.topo, self.run.topo.rank
        if clock().problem:  # ranges or device marks that failed (and were turned off)
            self.error = "; ".join(e for e in (self.error, clock().problem) if e)
        part = {
            "rank": rank,
            "world": topo.world,
            "host": socket.gethostname(),  # (ranks on one host share its cores: cpu.py)
            "coords": {d: topo.coord(d) for d in ("dp", "tp", "pp", "cp", "ep")},
            "sync_wall": time.time() - (time.perf_counter() - self.sync),
            "steps": self.steps,
            "traced_ledger": self.traced_ledger,
            "device_ledger": self.device_ledger,
            "events": [
                (c, round(a - self.sync, 7), round(b - self.sync, 7)) for c, a, b in self.events
            ],
            "trace": trace_name(rank) if (self.dir / trace_name(rank)).is_file() else None,
            "error": self.error,
        }
        tmp = self.dir / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(part))
        os.replace(tmp, self.dir / f"rank{rank}.json")
        self._barrier()


def _start_profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, record_shapes=False, with_stack=False)
    with _quiet_stderr():
        prof.start()
    return prof


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto prints a line per rank on every start and stop straight to fd 2 (no log level
    turns it off in torch 2.13): drop them; Python exceptions still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _export(prof, path: Path, cap: int) -> dict:
    """Write the Chrome/Perfetto trace, bounded to the `cap` longest events (metadata kept);
    returns it whole."""
    tmp = path.with_name(path.name + ".tmp")
    prof.export_chrome_trace(str(tmp))
    trace = json.loads(tmp.read_text())
    events = trace.get("traceEvents", [])
    meta = [e for e in events if e.get("ph") == "M"]
    timed = [e for e in events if e.get("ph") != "M"]
    if len(timed) > cap:
        timed.sort(key=lambda e: -float(e.get("dur", 0)))
        bounded = {**trace, "traceEvents": meta + timed[:cap]}
        bounded["shardwise_dropped_events"] = len(timed) - cap
        tmp.write_text(json.dumps(bounded))
    os.replace(tmp, path)
    return trace
