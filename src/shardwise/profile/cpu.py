"""Whether a rank got the CPU it asked for: per measured step, the process's CPU time and the
training thread's time on a CPU and waiting for one.

CPU time below wall time alone says little: a rank that sleeps for its data, or blocks in a
collective waiting for its peer, uses no CPU then, and that is no contention. What contention
is: a thread ready to run that the scheduler keeps waiting for a core. Linux counts exactly
that per thread (`/proc/thread-self/schedstat`: nanoseconds on a CPU, nanoseconds runnable on
a run queue). The training thread runs the forward, backward and optimizer of a CPU rank and
every launch of a CUDA one, so its run-queue wait is time the step loses to other threads
(its own rank's or another rank's helpers, or other jobs). Where the kernel does not report
it, the wait is None and no contention is claimed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def snapshot() -> tuple[float, float, float | None, float | None]:
    """(wall, process CPU, this thread's CPU, this thread's run-queue wait) in seconds; the
    last two None where the OS does not report them."""
    wall, process = time.perf_counter(), time.process_time()
    try:
        on_cpu, waited, _ = _SCHEDSTAT.read_text().split()
        return wall, process, int(on_cpu) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):  # (not Linux, or schedstat off: CPU time only)
        return wall, process, time.thread_time(), None


def between(a: tuple, b: tuple) -> dict[str, float | None]:
    """What one step used from snapshot `a` to snapshot `b`: `wall_s`, `process_cpu_s` (every
    thread of the rank), `thread_cpu_s` and `run_wait_s` (the training thread), and the
    `cores` the rank may use."""
    wait = None if a[3] is None or b[3] is None else round(b[3] - a[3], 6)
    return {
        "wall_s": round(b[0] - a[0], 6),
        "process_cpu_s": round(b[1] - a[1], 6),
        "thread_cpu_s": round(b[2] - a[2], 6),
        "run_wait_s": wait,
        "cores": cores(),
    }


def cores() -> int:
    """The cores this process may run on (its affinity; all of them where not reported)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
