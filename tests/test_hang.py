"""Hang diagnosis: a skipped collective and a rank that sleeps forever stop
the job within timeout + 30 s with one report naming the rank and the collective; the report
analysis itself is checked on hand-made traces (a silent rank, a different collective, the
groups of a 3-D mesh)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwise.distributed.comm import TraceEntry
from shardwise.distributed.hangreport import compose, disagreements, groups
from shardwise.distributed.watchdog import Watchdog
from support.compare import SMALL
from support.faultjob import job_env

# Short, so the tests stop quickly, but not so short that a rank starved of CPU on a loaded
# 2-core machine (several ranks per core) looks hung.
TIMEOUT_S = 8.0
HOOKS = "support.hooks:"


def _start(hook: str, run_dir: Path, *extra: str) -> subprocess.Popen:
    """`shardwise train --nproc 2` with a fault hook, in its own process (its output kept)."""
    run_dir.mkdir(parents=True)
    args = [
        *SMALL,
        "--train.steps=6",
        "--log.tensorboard=false",
        "--log.progress=off",
        "--run.device=cpu",
        f"--parallel.timeout_s={TIMEOUT_S}",
        f"--run.dir={run_dir}",
        *extra,
    ]
    cmd = [sys.executable, "-m", "support.faultjob", HOOKS + hook, "2", *args]
    with (run_dir / "job.out").open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=job_env())


@pytest.fixture(scope="module")
def hung_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The faulty jobs at once (side by side: process start-up dominates)."""
    jobs = {
        "skip_loss_reduce_on_rank1": (),
        "sleep_forever_on_rank1": (),
        "skip_block1_on_rank1": ("--parallel.zero=3",),  # ZeRO-3 units diverge
    }
    root = tmp_path_factory.mktemp("hang")
    procs = {hook: _start(hook, root / hook, *extra) for hook, extra in jobs.items()}
    results: dict[str, dict] = {}
    deadline = time.monotonic() + 300
    while procs and time.monotonic() < deadline:
        for hook, proc in list(procs.items()):
            if proc.poll() is not None:
                out = (root / hook / "job.out").read_text()
                results[hook] = {"dir": root / hook, "rc": proc.returncode, "out": out}
                results[hook]["end"] = time.time()
                del procs[hook]
        time.sleep(0.2)
    for proc in procs.values():
        proc.kill()
    assert not procs, f"{sorted(procs)} did not stop: an endless hang"
    return results


def _report(job: dict) -> str:
    assert job["rc"] == 2 and "the hang watchdog stopped the job" in job["out"], job["out"]
    return job["out"]


def _dp_number(first: str) -> int:
    """N of the report's 'first disagreement: dp collective #N among ranks [0, 1]'."""
    m = re.match(r"first disagreement: dp collective #(\d+) among ranks \[0, 1\]:", first)
    assert m, first
    return int(m.group(1))


def _stopped_within_bound(job: dict) -> float:
    mark = job["dir"] / "fault_injected"
    assert mark.is_file(), f"the job stopped before the fault was injected:\n{job['out']}"
    kind, injected = mark.read_text().split()
    waited = job["end"] - float(injected)
    assert waited <= TIMEOUT_S + 30, f"{kind}: stopped {waited:.1f} s after the fault"
    return waited


@pytest.mark.slow
def test_skipped_collective_is_reported(hung_jobs: dict[str, dict]) -> None:
    job = hung_jobs["skip_loss_reduce_on_rank1"]
    report = _report(job)
    _stopped_within_bound(job)
    first = next(line for line in report.splitlines() if line.startswith("first disagreement"))
    # the skipped call: the loss all-reduce of step 3, made by rank 0 only, at its call site
    # in the training loop; rank 1 made every dp collective before it
    n = _dp_number(first)
    assert f"rank(s) [0] called all_reduce over dp (#{n} on dp, shape ()" in first, report
    assert "at loop.py:" in first
    assert f"rank 1 never called it (its last dp collective is #{n - 1};" in first
    # and where rank 1 went instead
    assert "waiting" in first and "all_reduce over world" in first and "loop.py:" in first
    assert (job["dir"] / "hang_report.txt").read_text().strip() in report
    for rank in (0, 1):
        assert (job["dir"] / "hang" / f"rank-{rank:05d}.trace").is_file()


@pytest.mark.slow
def test_rank_sleeping_forever_is_reported(hung_jobs: dict[str, dict]) -> None:
    job = hung_jobs["sleep_forever_on_rank1"]
    report = _report(job)
    _stopped_within_bound(job)
    first = next(line for line in report.splitlines() if line.startswith("first disagreement"))
    # rank 0 waits in the gradient all-reduce of step 3; rank 1 sleeps in its forward
    n = _dp_number(first)
    assert f"rank(s) [0] called all_reduce over dp (#{n} on dp" in first, report
    assert "at data.py:" in first
    assert f"rank 1 never called it (its last dp collective is #{n - 1};" in first
    assert "is not in a collective" in first
    assert "main thread at hooks.py" in first and "in sleeping" in first


@pytest.mark.slow
def test_zero3_rank_dependent_control_flow_is_reported(hung_jobs: dict[str, dict]) -> None:
    """Rank 1 skips block 1 once under ZeRO-3: the unit gathers of the two ranks no longer
    pair up. The job stops with the report naming the diverging collectives (ZeRO's gathers
    and reduce-scatters at their call sites) and the ZeRO-3 fix."""
    job = hung_jobs["skip_block1_on_rank1"]
    report = _report(job)
    _stopped_within_bound(job)
    first = next(line for line in report.splitlines() if line.startswith("first disagreement"))
    assert "dp collective #" in first and "among ranks [0, 1]" in first, report
    assert "rank(s) [0] called" in first and "rank(s) [1] called" in first
    assert "the ranks call different collectives here" in first
    # the engine's gathers are at zero_gather.py's lines, its reduce-scatters at zero.py's
    assert len(re.findall(r"at zero(?:_gather)?\.py:", first)) == 2, first
    assert (
        "hint: ZeRO-3 gathers every unit collectively" in report and "--parallel.zero=2" in report
    )


def _entry(seq: int, op: str, dim: str, n: int, site: str, shape=(4,)) -> list:
    return [seq, op, dim, list(shape), "torch.float32", site, n]


def _dump(rank: int, trace: list, blocked: bool, dp: int = 2, stack=None) -> dict:
    dim_seq: dict[str, int] = {}
    for e in trace:
        dim_seq[e[2]] = max(dim_seq.get(e[2], 0), e[6])
    return {
        "rank": rank,
        "coords": {"pp": 0, "dp": rank % dp, "tp": 0},
        "sizes": {"pp": 1, "dp": dp, "tp": 1},
        "trace": trace,
        "dim_seq": dim_seq,
        "blocked": {"entry": trace[-1], "for_s": 6.0} if blocked else None,
        "stack": stack or [],
        "state": "running",
    }


def _steps(n_steps: int, seq: int = 0) -> list:
    out = []
    for s in range(1, n_steps + 1):
        out.append(_entry(seq := seq + 1, "all_reduce", "dp", s, "data.py:87", (100,)))
        out.append(_entry(seq := seq + 1, "all_reduce", "world", s, "train.py:58", ()))
    return out


def test_report_names_a_silent_rank_from_its_last_heartbeat() -> None:
    base = _steps(2)
    waiting = [*base, _entry(5, "all_reduce", "dp", 3, "data.py:87", (100,))]
    heartbeat = {**_dump(1, base, blocked=False), "age_s": 12.5}
    text = compose(
        2,
        {"dp": 2},
        5.0,
        "rank 1 sent no heartbeat for 6.0 s",
        {0: _dump(0, waiting, True)},
        {1: heartbeat},
    )
    assert "first disagreement: dp collective #3 among ranks [0, 1]" in text
    assert "rank 1 never called it (its last dp collective is #2" in text
    assert "rank 1: SILENT: sent no dump, last heartbeat 12.5 s ago" in text
    # a rank about which nothing at all is known is named too
    text = compose(2, {"dp": 2}, 5.0, "timeout", {0: _dump(0, waiting, True)}, {})
    assert "rank 1 is not in it (it sent no dump and no heartbeat" in text


def test_report_names_a_different_collective() -> None:
    base = _steps(2)
    a = [*base, _entry(5, "all_reduce", "dp", 3, "data.py:87", (100,))]
    b = [*base, _entry(5, "all_gather", "dp", 3, "zero.py:120", (50,))]
    found = disagreements(2, {"dp": 2}, {0: _dump(0, a, True), 1: _dump(1, b, True)})
    assert [(d.dim, d.n, d.missing) for d in found] == [("dp", 3, ())]
    text = compose(2, {"dp": 2}, 5.0, "timeout", {0: _dump(0, a, True), 1: _dump(1, b, True)}, {})
    assert "rank(s) [1] called all_gather over dp" in text and "zero.py:120" in text
    assert "the ranks call different collectives here" in text


def test_zero_call_sites_give_the_zero3_hint_once() -> None:
    """A disagreement at the ZeRO engine's call sites (gathers in zero_gather.py,
    reduce-scatters in zero.py) carries the ZeRO-3 hint, once."""
    base = _steps(2)
    a = [*base, _entry(5, "all_gather", "dp", 3, "zero_gather.py:81", (100,))]
    b = [*base, _entry(5, "reduce_scatter", "dp", 3, "zero.py:180", (50,))]
    dumps = {0: _dump(0, a, True), 1: _dump(1, b, True)}
    text = compose(2, {"dp": 2}, 5.0, "timeout", dumps, {})
    assert text.count("hint: ZeRO-3 gathers every unit collectively") == 1, text
    # two different units' gathers (rank 1 skipped one): both sites are zero_gather.py's
    c = [*base, _entry(5, "all_gather", "dp", 3, "zero_gather.py:81", (60,))]
    text = compose(2, {"dp": 2}, 5.0, "timeout", {0: dumps[0], 1: _dump(1, c, True)}, {})
    assert text.count("hint: ZeRO-3 gathers every unit collectively") == 1, text


def test_no_disagreement_when_traces_agree() -> None:
    t = _steps(3)
    assert disagreements(2, {"dp": 2}, {0: _dump(0, t, False), 1: _dump(1, t, False)}) == []


def test_groups_of_a_3d_mesh() -> None:
    got = groups(8, {"pp": 2, "dp": 2, "tp": 2})
    assert ("world", tuple(range(8))) in got
    assert {g for d, g in got if d == "tp"} == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert {g for d, g in got if d == "dp"} == {(0, 2), (1, 3), (4, 6), (5, 7)}
    assert {g for d, g in got if d == "pp"} == {(0, 4), (1, 5), (2, 6), (3, 7)}


class _Topo:
    world = 2

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def size(self, dim: str) -> int:
        return 2 if dim == "dp" else 1

    def coord(self, dim: str) -> int:
        return self.rank if dim == "dp" else 0


class _Comm:
    def __init__(self, rank: int) -> None:
        self.topo, self.trace, self.dim_seq, self.blocked = _Topo(rank), deque(), {}, None


class _Stopped(Watchdog):
    def _exit(self) -> None:  # the real one ends the process (with EXIT_HANG)
        self._stop.set()


def test_a_rank_that_stops_sending_heartbeats_is_reported(tmp_path: Path) -> None:
    """Rank 1 beats once and then freezes (no heartbeat, no dump): rank 0's watchdog, which
    watches rank 1's heartbeat, stops the job and names it, although rank 0 is not blocked."""
    store = dist.HashStore()
    frozen = _Stopped(_Comm(1), store, timeout_s=1.0, run_dir=str(tmp_path), poll_s=0.1)
    frozen._beat()  # alive once, never again
    watcher = _Stopped(
        _Comm(0), store, timeout_s=1.0, run_dir=str(tmp_path), poll_s=0.1, grace_s=0.5
    )
    watcher.ns = frozen.ns  # one process plays both ranks: same keys
    start = time.monotonic()
    watcher.start().thread.join(timeout=30)
    assert not watcher.thread.is_alive() and time.monotonic() - start < 10
    report = (tmp_path / "hang_report.txt").read_text()
    assert "rank 1 sent no heartbeat for" in report.splitlines()[0]
    assert "rank 1: SILENT: sent no dump" in report


class _GoneStore:
    """A store whose host has died: every call fails as a TCPStore's does then."""

    def __getattr__(self, name: str):
        def gone(*args, **kwargs):
            raise RuntimeError("Broken pipe")

        return gone


def test_a_rank_blocked_when_the_store_dies_exits_after_the_grace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The store went with the rank that held it while this rank waits in a collective: the
    watchdog ends the process once it has waited grace_s (it used to stop watching, leaving
    the wait to the launcher's SIGKILL); a rank that is not blocked is left alone."""
    comm = _Comm(1)
    dog = _Stopped(comm, dist.HashStore(), timeout_s=60.0, run_dir=str(tmp_path), poll_s=0.05)
    dog.store, dog.grace_s = _GoneStore(), 0.3
    entry = TraceEntry(7, "all_reduce", "dp", (4,), "torch.float32", "loop.py:1")
    comm.blocked = (entry, time.monotonic())
    start = time.monotonic()
    dog.thread.start()
    dog.thread.join(timeout=30)
    assert not dog.thread.is_alive() and 0.3 < time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert "stopped: Broken pipe" in err and "the job's store is gone (Broken pipe)" in err
    assert "all_reduce" in err and "exiting" in err
    idle = _Stopped(_Comm(1), dist.HashStore(), timeout_s=60.0, run_dir=str(tmp_path), poll_s=0.05)
    idle.store, idle.grace_s = _GoneStore(), 0.3
    idle.thread.start()
    time.sleep(1.0)
    assert idle.thread.is_alive()  # not blocked: nothing to end
    idle.stop()
    assert not idle.thread.is_alive()


def test_text_read_off_the_store_cannot_drive_the_terminal() -> None:
    """Anyone who could write to the rendezvous store must not print escape sequences into
    the user's terminal or hang_report.txt through the report."""
    base = _steps(2)
    hostile = [*base, _entry(5, "all_reduce", "dp", 3, "\x1b[2J\x1b]0;owned\x07data.py:87", (1,))]
    text = compose(
        2,
        {"dp": 2},
        5.0,
        "timeout \x1b[31mred\x1b[0m\r\x00",
        {0: _dump(0, hostile, True), 1: _dump(1, base, True)},
        {},
    )
    assert not any(c in text for c in "\x1b\x07\r\x00")
    assert "timeout ?[31mred?[0m??" in text and "data.py:87" in text and "\n" in text
