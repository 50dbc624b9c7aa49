"""Where one rank's time goes: an exclusive stopwatch by category (the step ledger's source).

The loop marks its regions (`data`, `forward`, `backward`, `optimizer`, `checkpoint`, `eval`),
the pipeline schedule its idle waits (`bubble`), recomputation its replayed forwards
(`recompute`), and comm.py every blocking collective (`comm:dp`, `comm:tp`, `comm:pp`,
`comm:world`). Regions nest; time is charged to the innermost open one only, so a collective
inside backward is communication, not compute, and the categories of a span add up to its wall
time (what no region claims is `other`). One clock per process (a rank): like torch.profiler
it is process state, read by the loop and written from wherever time is spent. Off, every call
costs one attribute test.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

BASE = "other"
# host waits whose cost to the device a profile measures on CUDA (the host's own time is a
# wait; the device may go on with queued work meanwhile)
STALLS = frozenset({"data"})
_NULL = contextlib.nullcontext()


class Clock:
    def __init__(self) -> None:
        self.on = True
        self.entered = 0  # regions entered: what the clock costs is this times one entry
        self.stack: list[str] = [BASE]
        self.totals: dict[str, float] = defaultdict(float)
        self.mark = time.perf_counter()
        # seconds async collectives were in flight while this rank went on (per dim: from
        # the first one's issue until a wait blocks, the union of their spans)
        self.overlapped: dict[str, float] = defaultdict(float)
        self.in_flight: dict[str, int] = defaultdict(int)
        self.since: dict[str, float] = {}
        # when profiling: every charged interval (category, start, end) for the timeline, and
        # every blocking call (dim, index on dim, an async wait?, seconds) for the
        # straggler analysis
        self.events: list[tuple[str, float, float]] | None = None
        self.calls: list[tuple[str, int, bool, float]] | None = None
        # while a profile traces a step: each region also opened as a torch.profiler range
        # named `sw:<category>`, so the device ledger can tell which region launched a kernel
        self.ranges: list[tuple[int, object]] | None = None
        # while a profile measures steps on CUDA: a device mark (distributed/device.py
        # stall_marker) at each entry and exit of a host wait (`STALLS`); (category, start,
        # end) per wait in `stalls`: how long the device sat idle because of it
        self.marker = None
        self.stalls: list[tuple[str, object, object]] = []
        self._marks: list[tuple[int, object]] = []
        self.problem: str | None = None  # why those were turned off (see `_profiled`)

    def _charge(self, now: float) -> None:
        top = self.stack[-1]
        self.totals[top] += now - self.mark
        if self.events is not None and now > self.mark:
            self.events.append((top, self.mark, now))
        self.mark = now

    def enter(self, category: str) -> None:
        self._charge(time.perf_counter())
        self.stack.append(category)
        self.entered += 1
        if self.ranges is not None or self.marker is not None:
            self._profiled(self._open, category)

    def exit(self) -> None:
        self._charge(time.perf_counter())
        if len(self.stack) > 1:
            if self.ranges or self._marks:
                self._profiled(self._close, self.stack[-1])
            self.stack.pop()

    def _open(self, category: str) -> None:
        if self.ranges is not None:
            self.ranges.append((len(self.stack), _open_range(category)))
        if self.marker is not None and category in STALLS:
            self._marks.append((len(self.stack), self.marker()))

    def _close(self, category: str) -> None:
        if self.ranges and self.ranges[-1][0] == len(self.stack):  # opened as a range
            self.ranges.pop()[1].__exit__(None, None, None)
        if self._marks and self._marks[-1][0] == len(self.stack) and self.marker:
            start = self._marks.pop()[1]
            self.stalls.append((category, start, self.marker()))

    def _profiled(self, step, category: str) -> None:
        """A profile's extra work at a region's edge; a failure turns it off and is kept in
        `problem` (the profile reports it), never stops the job or unbalances the stack."""
        try:
            step(category)
        except Exception as exc:  # (any failure of the profiler or the device's events)
            self.problem = f"profile ranges/device marks turned off: {exc}"
            self.ranges, self.marker, self._marks = None, None, []

    def mark_stalls(self, marker) -> None:
        """Mark every host wait with `marker` from now on (None: stop); forgets earlier marks."""
        self.marker, self.stalls, self._marks = marker, [], []

    def take_stalls(self, elapsed) -> dict[str, float]:
        """Seconds the device stalled per wait category since the last take (the marks must
        have completed: after the step's synchronize); `elapsed(start, end)` reads a pair."""
        out: dict[str, float] = {}
        for category, start, end in self.stalls:
            out[category] = out.get(category, 0.0) + elapsed(start, end)
        self.stalls = []
        return out

    def annotate(self, on: bool) -> None:
        """Open every region from now on as a profiler range too (off: close those open)."""
        while self.ranges:
            self.ranges.pop()[1].__exit__(None, None, None)
        self.ranges = [] if on else None

    @contextlib.contextmanager
    def _phase(self, category: str):
        self.enter(category)
        try:
            yield
        finally:
            self.exit()

    def phase(self, category: str):
        """A context charging its (exclusive) time to `category`."""
        return self._phase(category) if self.on else _NULL

    def comm(self, dim: str):
        """A blocking collective over `dim`: charged as `comm:dim`, except inside a pipeline
        wait, where a stage blocked on its neighbour is idle by the schedule (`bubble`)."""
        if not self.on or self.stack[-1] == "bubble":
            return _NULL
        return self._phase(f"comm:{dim}")

    def issued(self, dim: str) -> None:
        """An async collective over `dim` was issued."""
        if self.in_flight[dim] == 0:
            self.since[dim] = time.perf_counter()
        self.in_flight[dim] += 1

    def waits(self, dim: str) -> None:
        """A wait on one of them begins: until here they ran behind other work."""
        if self.in_flight[dim] > 0:
            self.overlapped[dim] += time.perf_counter() - self.since[dim]

    def waited(self, dim: str) -> None:
        """That wait returned (what stays in flight runs hidden again from now)."""
        self.in_flight[dim] = max(0, self.in_flight[dim] - 1)
        self.since[dim] = time.perf_counter()

    def start(self) -> float:
        """Begin a span (a step): forget what came before; returns its start time."""
        now = time.perf_counter()
        self.totals.clear()
        self.overlapped.clear()
        self.since = dict.fromkeys(self.since, now)
        self.mark = now
        return now

    def take(self) -> tuple[float, dict[str, float], dict[str, float]]:
        """(now, seconds by category, overlapped seconds by dim) since `start` or the last
        `take`, which begins the next span: consecutive spans miss nothing between them."""
        now = time.perf_counter()
        self._charge(now)
        for dim, n in self.in_flight.items():  # still in flight: counted up to here
            if n > 0:
                self.overlapped[dim] += now - self.since[dim]
                self.since[dim] = now
        out = now, dict(self.totals), dict(self.overlapped)
        self.totals.clear()
        self.overlapped.clear()
        return out


def _open_range(category: str):
    import torch

    rng = torch.autograd.profiler.record_function(f"sw:{category}")
    rng.__enter__()
    return rng


_CLOCK = Clock()


def clock() -> Clock:
    """This process's clock."""
    return _CLOCK
