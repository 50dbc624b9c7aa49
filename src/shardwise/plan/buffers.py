"""ZeRO's flat buffers before launch: how a unit's parameters pad and align into dp equal
shards (parallel/zero_units.Unit), and the temporary buffers a step holds beside the model
states (gathered units, gradients being reduced; `zero_transient`), replaying the engine's
schedule (parallel/zero.py) or, for another framework's blocking per-parameter calls
(peers.Deviations.zero3_per_tensor), one tensor at a time."""

from __future__ import annotations

from functools import lru_cache

from shardwise.optim import QUANT_BLOCK
from shardwise.plan import peers
from shardwise.plan.layout import Job
from shardwise.plan.shapes import Unit


def up(x: int, k: int) -> int:
    return -(-x // k) * k


def align_of(job: Job) -> int:
    """Elements ZeRO aligns parameters and shards to (optim.QUANT_BLOCK for 8-bit Adam)."""
    return QUANT_BLOCK if job.finetune.optim_8bit else 1


def padded_numel(u: Unit, dp: int, align: int = 1) -> int:
    """A unit's flat buffer over dp ranks: parameters on multiples of `align`, padded to dp
    equal shards of a multiple of it (zero_units.Unit)."""
    end = 0
    for e in u.entries:
        end = up(end + e[0], align)
    return up(-(-end // dp), align) * dp


def zero_transient(
    us: list[Unit],
    job: Job,
    dp: int,
    stage: int,
    wire: int = 0,
    tied: bool = False,
    siblings: tuple[str, ...] = ("[frozen]",),
) -> float:
    """`_zero_transient` for `job`; `wire`: bytes per element of a 16-bit copy each
    reduce-scatter sends (parallel.grad_compression=bf16/fp16), 0 without. An engine that
    gathers parameter by parameter (peers.Deviations.zero3_per_tensor) holds one tensor, not a
    unit. `tied`: the first root's units are used again by the last root (a head tied to the
    embedding). `siblings`: the suffixes of units that belong to the root before them (ZeRO-3
    under expert parallelism: a root's expert unit is gathered with it, parallel/zero.py)."""
    if peers.of(job).zero3_per_tensor and stage == 3:
        return _blocking_transient(us, job, dp)
    us_, bc, br, align = tuple(us), job.bc, job.br, align_of(job)
    return _zero_transient(us_, dp, stage, bc, br, align, wire, tied, siblings)


def _blocking_transient(us: list[Unit], job: Job, dp: int) -> float:
    """ZeRO-3 gathering and reducing parameter by parameter, each call blocking (DeepSpeed
    2021): nothing is prefetched and no reduction is left in flight, so the peak is the
    largest tensor gathered and its gradient; a gather into a list of per-rank views
    (peers.Deviations.list_all_gather) also holds c10d's flat buffer of it until copied out."""
    align, peak = align_of(job), 0.0
    for u in us:
        for e in u.entries:
            full = padded_numel(Unit(u.name, (e,), 1), dp, align)
            gather = full * job.bc * (2 if peers.of(job).list_all_gather else 1)
            peak = max(peak, gather, full * job.bc + (full * job.br if e[1] else 0))
    return peak


def _roots(us: tuple, siblings: tuple[str, ...] = ("[frozen]",)) -> list[list[Unit]]:
    """The units of each root module in forward order (a root's trainable unit and its
    `siblings`, by default its `[frozen]` one, together; repeated blocks expanded)."""
    out, i = [], 0
    while i < len(us):
        group = [us[i]]
        while i + 1 < len(us) and us[i + 1].name in {f"{group[0].name}{s}" for s in siblings}:
            group.append(us[i + 1])
            i += 1
        out += [group] * us[i].count
        i += 1
    return out


@lru_cache(maxsize=8192)
def _zero_transient(
    us: tuple,
    dp: int,
    stage: int,
    bc: int,
    br: int,
    align: int = 1,
    wire: int = 0,
    tied=False,
    siblings: tuple[str, ...] = ("[frozen]",),
) -> float:
    """Peak bytes of ZeRO's temporary buffers, replaying the engine's schedule (zero.py): ZeRO-3
    holds the root it runs plus the prefetched next unit (backward: the previous root's last
    unit); ZeRO-2/3 reduce-scatter each trainable unit's gradients from a fresh flat buffer, at
    most three in flight (two pending, one launching). Backward visits roots in reverse; at root
    k: F_k + F_last(k-1) + G_k + G_k+1 + G_k+2 (a frozen unit has no G; a root of several
    trainable units, under expert parallelism, holds them as that many of the three G, and
    ZeRO-3 frees each of them, its expert unit first, as soon as its G is launched). A
    16-bit wire adds its copy to each G (ZeRO-1: G is only that copy; its flat buffer is
    persistent). A tied head gathers the first root's units again before backward, and they
    stay gathered until their gradients (both uses') are reduced, after the first root's
    backward: + F_0."""
    if stage < 2 and not (stage == 1 and wire):
        return 0.0
    roots = _roots(us, siblings)

    def size(u: Unit, nbytes: int) -> int:
        return padded_numel(u, dp, align) * nbytes

    full = [[size(u, bc) if stage == 3 else 0 for u in r] for r in roots]
    per = (br if stage >= 2 else 0) + wire
    # the gradients in flight are counted unit by unit (the engine reduces units, not roots: a
    # root's expert unit is one of the three); a root without trainable units takes a slot.
    # Each with its gathered bytes: ZeRO-3 frees a unit once its reduce-scatter is launched,
    # before the root's next unit (its dense one, after the experts) allocates its buffer
    grad = [
        [(size(u, per), f) for u, f in zip(r, fs, strict=True) if any(e[1] for e in u.entries)]
        or [(0, 0)]
        for r, fs in zip(roots, full, strict=True)
    ]
    n, peak = len(roots), 0.0
    for k in range(n):  # forward: the running root + the next root's first unit, prefetched
        peak = max(peak, sum(full[k]) + (full[k + 1][0] if k + 1 < n else 0))
    flight: list[int] = []  # gradient buffers in backward order, the latest last
    for k in range(n - 1, -1, -1):
        gathered = sum(full[k]) + (full[k - 1][-1] if k > 0 else 0)
        gathered += sum(full[0]) if tied and k > 0 else 0
        for g, f in reversed(grad[k]):  # the root's units in backward (reverse) order
            flight.append(g)
            peak = max(peak, gathered + sum(flight[-3:]))
            gathered -= f
    return peak
