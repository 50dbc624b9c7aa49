"""Pipeline schedules as data: for every pipeline rank, the ordered list of passes it runs.

A pass is forward (F), full backward (B), or — for the zero-bubble schedule — the backward
split into its input-gradient (I) and weight-gradient (W) halves (Qi et al. 2023). Passes name
a *local* chunk k (rank r holds the global chunks k·p + r, Megatron's interleaved placement)
and a micro-batch. Schedules are pure functions of (p, m, v), so every rank derives the same
plan, and `simulate` replays a plan under given pass times: tests use it to prove a plan can
neither deadlock nor mis-pair messages, and to compute the bubble and in-flight activations
the formulas predict.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class Pass(enum.Enum):
    F = "F"  # forward
    B = "B"  # backward: input and weight gradients
    I = "I"  # noqa: E741  input gradient only (zero bubble)
    W = "W"  # weight gradient only (zero bubble)


class Action(NamedTuple):
    kind: Pass
    chunk: int  # local virtual chunk index k on this rank
    mb: int  # micro-batch


Plan = list[list[Action]]  # plan[r] = rank r's passes in order


def gpipe(p: int, m: int, v: int = 1) -> Plan:
    """GPipe (Huang et al. 2019): every forward, then every backward. m in flight."""
    plan = []
    for _ in range(p):
        # all forwards
        acts = [Action(Pass.F, 0, i) for i in range(m)]
        # all backwards, in the order the forwards ran
        acts += [Action(Pass.B, 0, i) for i in range(m)]
        plan.append(acts)
    return plan


def one_f_one_b(p: int, m: int, v: int = 1) -> Plan:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r runs p − r − 1 warm-up
    forwards, then alternates one forward and one backward, then drains. At most p − r
    micro-batches in flight."""
    plan = []
    for r in range(p):
        warm = min(p - r - 1, m)
        # warmup
        acts = [Action(Pass.F, 0, i) for i in range(warm)]
        # steady 1F1B
        for i in range(m - warm):
            acts += [Action(Pass.F, 0, warm + i), Action(Pass.B, 0, i)]
        # cooldown
        acts += [Action(Pass.B, 0, i) for i in range(m - warm, m)]
        plan.append(acts)
    return plan


def interleaved(p: int, m: int, v: int) -> Plan:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2): each rank holds v chunks; micro-batches
    advance through the chunks in groups of p. Needs m to be a multiple of p. Bubble
    (p − 1)/(v·m + p − 1)."""
    total = m * v

    def chunk_mb(j: int, backward: bool) -> tuple[int, int]:
        k = (j // p) % v
        return (v - 1 - k if backward else k), (j // (p * v)) * p + j % p

    plan = []
    for r in range(p):
        # Megatron's warm-up: enough forwards that the first backward finds its gradient
        warm = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
        # warmup
        acts = [Action(Pass.F, *chunk_mb(j, False)) for j in range(warm)]
        # steady 1F1B
        for i in range(total - warm):
            acts += [Action(Pass.F, *chunk_mb(warm + i, False))]
            acts += [Action(Pass.B, *chunk_mb(i, True))]
        # cooldown
        acts += [Action(Pass.B, *chunk_mb(i, True)) for i in range(total - warm, total)]
        plan.append(acts)
    return plan


def zero_bubble(p: int, m: int, v: int = 1) -> Plan:
    """ZB-H1 (Qi et al. 2023, §3): 1F1B with the backward split into I and W. I stays on the
    critical path; rank r defers its weight gradients by r micro-batches, so the later ranks
    send input gradients upstream sooner and run their deferred W passes while the earlier
    ranks drain. The first rank defers none, so the peak in-flight count is 1F1B's p."""
    plan = []
    for r in range(p):
        warm, lag = min(p - r - 1, m), r
        acts = [Action(Pass.F, 0, i) for i in range(warm)]
        done_w = 0

        def weights(upto: int) -> list[Action]:
            nonlocal done_w
            out = [Action(Pass.W, 0, i) for i in range(done_w, max(done_w, upto))]
            done_w = max(done_w, upto)
            return out

        # warmup
        # steady: F, I, and the W of the micro-batch `lag` behind
        for i in range(m - warm):
            acts += [Action(Pass.F, 0, warm + i), Action(Pass.I, 0, i)]
            acts += weights(i + 1 - lag)
        # cooldown: the remaining I passes, each followed by one deferred W
        for i in range(m - warm, m):
            acts += [Action(Pass.I, 0, i)]
            acts += weights(done_w + 1)
        # drain the deferred weight gradients
        acts += weights(m)
        plan.append(acts)
    return plan


SCHEDULES: dict[str, Callable[[int, int, int], Plan]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb": zero_bubble,
}


def build_plan(name: str, p: int, m: int, v: int) -> Plan:
    """The plan of schedule `name` (a `parallel.pp_schedule` value)."""
    return SCHEDULES[name](p, m, v)


# -- replay ---------------------------------------------------------------------------------


@dataclass
class Replay:
    makespan: float
    busy: list[float]  # per rank
    in_flight: list[int]  # per rank: the most micro-batches whose activations are held

    @property
    def bubble(self) -> list[float]:
        return [1.0 - b / self.makespan for b in self.busy]


def _global(action: Action, r: int, p: int) -> int:
    return action.chunk * p + r


def simulate(
    plan: Plan,
    v: int,
    cost: dict[Pass, float] | None = None,
    durations: list[list[float]] | None = None,
) -> Replay:
    """Replay `plan` with pass times `cost` (default F=1, B=2, I=W=1), or each rank's own
    measured time of each of its passes (`durations[r][j]`), and free messages.

    Raises ValueError on a deadlock, or when a channel (sender, receiver) would carry
    messages in a different order than the receiver posts its receives: point-to-point
    messages between two ranks pair up in order (NCCL ignores tags), so activations and
    gradients sharing a channel must be received in the order they were sent."""
    cost = cost or {Pass.F: 1.0, Pass.B: 2.0, Pass.I: 1.0, Pass.W: 1.0}
    p = len(plan)
    chunks = p * v
    done: dict[tuple[Pass, int, int], float] = {}
    clock, pos = [0.0] * p, [0] * p
    busy, held, peak = [0.0] * p, [0] * p, [0] * p
    sent: dict[tuple[int, int, int], list] = {}
    posted: dict[tuple[int, int, int], list] = {}
    split = any(a.kind is Pass.I for acts in plan for a in acts)
    while any(pos[r] < len(plan[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] == len(plan[r]):
                continue
            a = plan[r][pos[r]]
            c = _global(a, r, p)
            need = _needs(a.kind, c, a.mb, chunks)
            if need is not None and need not in done:
                continue
            start = max(clock[r], done.get(need, 0.0))
            took = durations[r][pos[r]] if durations else cost[a.kind]
            clock[r] = start + took
            busy[r] += took
            kind = Pass.I if a.kind is Pass.B else a.kind
            done[(kind, c, a.mb)] = clock[r]
            if a.kind is Pass.F:
                held[r] += 1
                peak[r] = max(peak[r], held[r])
            if a.kind is Pass.W or (a.kind is Pass.B and not split):
                held[r] -= 1
            _channels(a, c, chunks, p, sent, posted)
            pos[r] += 1
            progressed = True
        if not progressed:
            stuck = {r: plan[r][pos[r]] for r in range(p) if pos[r] < len(plan[r])}
            raise ValueError(f"pipeline plan deadlocks; waiting passes: {stuck}")
    for key, order in sent.items():
        if posted.get(key) != order:
            raise ValueError(f"channel {key} sends {order} but receives {posted.get(key)}")
    return Replay(max(clock), busy, peak)


def _needs(kind: Pass, c: int, mb: int, chunks: int) -> tuple[Pass, int, int] | None:
    if kind is Pass.F:
        return (Pass.F, c - 1, mb) if c > 0 else None
    if kind is Pass.W:
        return (Pass.I, c, mb)
    return (Pass.I, c + 1, mb) if c < chunks - 1 else (Pass.F, c, mb)


def _channels(a: Action, c: int, chunks: int, p: int, sent: dict, posted: dict) -> None:
    """Record the messages `a` receives (posted in program order) and sends."""
    r = c % p
    if a.kind is Pass.F:
        if c > 0:
            posted.setdefault(((r - 1) % p, r), []).append((Pass.F, c - 1, a.mb))
        if c < chunks - 1:
            sent.setdefault((r, (r + 1) % p), []).append((Pass.F, c, a.mb))
    elif a.kind in (Pass.B, Pass.I):
        if c < chunks - 1:
            posted.setdefault(((r + 1) % p, r), []).append((Pass.B, c + 1, a.mb))
        if c > 0:
            sent.setdefault((r, (r - 1) % p), []).append((Pass.B, c, a.mb))
