"""The hang report: from every rank's collective trace to one message naming the first
collective on which the ranks disagree, the rank(s) missing or calling something else, the
mesh dimension and the call site. Pure functions over plain dicts (what the watchdog
publishes), so the analysis is tested without processes.

A *dump* (one per rank that could still answer) is::

    {"rank": 1, "coords": {"pp": 0, "dp": 1, "tp": 0}, "sizes": {"pp": 1, "dp": 2, "tp": 1},
     "trace": [[seq, op, dim, shape, dtype, site, n], ...],   # oldest first
     "dim_seq": {"dp": 7, "world": 12},                      # collectives issued per dim
     "blocked": {"entry": [...], "for_s": 3.1} | None,
     "stack": ["hooks.py:80 in sleep_forever", ...],          # main thread, innermost first
     "state": "running" | "finished" | "failed: <error>"}

A rank that cannot answer (dead or frozen) is described by its last heartbeat (the same
fields, a shorter trace, and `age_s`: seconds since it last beat) or by nothing at all.

Why per group and not one global sequence: each process group (one line of the mesh along
one dimension, or all ranks for `world`) must see the same collectives in the same order on
every member, but ranks of different pipeline stages legitimately run different sequences.
So the k-th collective on a group is compared across the group's members, and a member whose
count on that group stops before k is *missing* it.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

DIMS = ("pp", "dp", "tp")
_ZERO3 = (
    "ZeRO-3 gathers every unit collectively, so the forward must call the same "
    "modules on every rank. Fix: make the control flow independent of the rank's data, or "
    "use --parallel.zero=2."
)
# What a disagreement at a call site usually means (file of the site -> hint); the ZeRO
# engine's gathers sit in zero_gather.py, its reduce-scatters in zero.py.
HINTS = {"zero.py": _ZERO3, "zero_gather.py": _ZERO3}


@dataclass(frozen=True)
class Disagreement:
    dim: str
    members: tuple[int, ...]
    n: int  # the group's collective index where the members first disagree
    present: dict[int, list]  # rank -> its trace entry at n
    missing: tuple[int, ...]  # ranks whose count on this group stops before n
    first_seq: int  # smallest global sequence number among the present entries


def _describe(e: list) -> str:
    _, op, dim, shape, dtype, site, n = e
    dtype = dtype.replace("torch.", "")
    return f"{op} over {dim} (#{n} on {dim}, shape {tuple(shape)}, {dtype}) at {site}"


def groups(world: int, sizes: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """Every process group as (dim, member ranks); ranks are row-major over (pp, dp, tp)."""
    out: list[tuple[str, tuple[int, ...]]] = [("world", tuple(range(world)))]
    dp, tp = sizes.get("dp", 1), sizes.get("tp", 1)
    strides = {"pp": dp * tp, "dp": tp, "tp": 1}
    for dim in DIMS:
        if sizes.get(dim, 1) == 1:
            continue
        seen: set[int] = set()
        for r in range(world):
            if r in seen:
                continue
            base = r - (r // strides[dim] % sizes[dim]) * strides[dim]
            line = tuple(base + i * strides[dim] for i in range(sizes[dim]))
            seen.update(line)
            out.append((dim, line))
    return out


def _on_dim(info: dict, dim: str) -> tuple[dict[int, list], int]:
    entries = {e[6]: e for e in info.get("trace", []) if e[2] == dim}
    return entries, int(info.get("dim_seq", {}).get(dim, max(entries, default=0)))


def _blocked_on(info: dict, dim: str) -> list | None:
    b = info.get("blocked")
    return b["entry"] if b and b["entry"][2] == dim else None


def _found(dim: str, members, n: int, present: dict, missing: tuple) -> Disagreement:
    first = min((e[0] for e in present.values()), default=0)
    return Disagreement(dim, tuple(members), n, present, missing, first)


def disagreements(world: int, sizes: dict[str, int], infos: dict[int, dict]) -> list[Disagreement]:
    """The first disagreement on every group, earliest (by global sequence) first. `infos`
    maps rank -> dump or last heartbeat; ranks without any are left out of the comparison."""
    found = []
    for dim, members in groups(world, sizes):
        views = {m: _on_dim(infos[m], dim) for m in members if m in infos}
        silent = tuple(m for m in members if m not in infos)
        lo = max((min(v[0], default=v[1] + 1) for v in views.values()), default=1)
        hi = max((v[1] for v in views.values()), default=0)
        for n in range(lo, hi + 1):
            present = {m: v[0][n] for m, v in views.items() if n in v[0]}
            missing = tuple(m for m, v in views.items() if v[1] < n)
            signatures = {tuple(map(str, e[1:6])) for e in present.values()}
            if missing or len(signatures) > 1:
                found.append(_found(dim, members, n, present, missing))
                break
        else:
            # the ranks that answered agree; a silent member is missing where they wait
            waiting = {m: b for m in views if (b := _blocked_on(infos[m], dim)) is not None}
            if silent and waiting:
                n = min(e[6] for e in waiting.values())
                present = {m: e for m, e in waiting.items() if e[6] == n}
                found.append(_found(dim, members, n, present, silent))
    order = {d: i for i, d in enumerate(("world", *DIMS))}
    # A rank that skipped a collective leaves two disagreements of equal age: the group it
    # skipped, and the next group it waits in, which the others have not reached. The one to
    # show first is the skipped one: a missing rank there broke its own earlier pattern.
    return sorted(
        found,
        key=lambda d: (
            not any(_deviates(infos[m]) for m in d.missing if m in infos),
            d.first_seq,
            order[d.dim],
        ),
    )


def key(e: list) -> tuple:
    """A call as the program sees it: op, dim and call site."""
    return (e[1], e[2], e[5])


def _deviates(info: dict) -> bool:
    """Whether the rank's latest collective followed a different one than the last time it
    made that same call (op, dim, site): the rank's own program order changed."""
    trace = info.get("trace", [])
    if len(trace) < 2:
        return False
    last = key(trace[-1])
    earlier = [i for i in range(len(trace) - 1) if key(trace[i]) == last]
    if not earlier:
        return True  # a call site never used before
    i = earlier[-1]
    return i > 0 and key(trace[i - 1]) != key(trace[-2])


def _where(info: dict | None) -> str:
    """What a rank is doing now, in words."""
    if info is None:
        return "sent no dump and no heartbeat (dead or never started)"
    if info.get("blocked"):
        b = info["blocked"]
        return f"is waiting ({b['for_s']:.1f} s) in {_describe(b['entry'])}"
    state = info.get("state", "running")
    if state != "running":
        return f"has left training ({state})"
    last = info["trace"][-1] if info.get("trace") else None
    done = f"last collective {_describe(last)}" if last else "no collective yet"
    stack = info.get("stack") or []
    at = f"; main thread at {stack[0]}" if stack else ""
    return f"is not in a collective ({done}){at}"


def _explain(d: Disagreement, infos: dict[int, dict]) -> str:
    head = f"{d.dim} collective #{d.n} among ranks {list(d.members)}"
    parts = []
    by_sig: dict[tuple, list[int]] = {}
    for rank, e in sorted(d.present.items()):
        by_sig.setdefault(tuple(map(str, e[1:6])), []).append(rank)
    for ranks in by_sig.values():
        parts.append(f"rank(s) {ranks} called {_describe(d.present[ranks[0]])}")
    for rank in d.missing:
        info = infos.get(rank)
        if info is None:
            parts.append(f"rank {rank} is not in it (it {_where(None)})")
            continue
        parts.append(
            f"rank {rank} never called it (its last {d.dim} collective is "
            f"#{_on_dim(info, d.dim)[1]}; it {_where(info)})"
        )
    if len(by_sig) > 1 and not d.missing:
        parts.append("the ranks call different collectives here")
    return f"{head}: " + "; ".join(parts)


def compose(
    world: int,
    sizes: dict[str, int],
    timeout_s: float,
    reason: str,
    dumps: dict[int, dict],
    heartbeats: dict[int, dict],
) -> str:
    """The one report the job stops with."""
    infos = {**heartbeats, **dumps}
    lines = [
        f"shardwise hang report: {reason} (parallel.timeout_s={timeout_s:g}).",
    ]
    found = disagreements(world, sizes, infos)
    if found:
        lines.append("first disagreement: " + _explain(found[0], infos) + ".")
        lines += [f"also: {_explain(d, infos)}." for d in found[1:]]
        sites = {e[5].split(":")[0] for e in found[0].present.values()}
        hints = dict.fromkeys(HINTS[f] for f in sorted(sites) if f in HINTS)  # each once
        lines += [f"hint: {h}" for h in hints]
    else:
        lines.append(
            "no disagreement in the collective sequences: every rank issued the same "
            "collectives (a rank is slow or stopped outside a collective)."
        )
    lines.append("ranks:")
    for rank in range(world):
        info = dumps.get(rank)
        if info is None and rank in heartbeats:
            hb = heartbeats[rank]
            if hb.get("state", "running") != "running":
                lines.append(f"  rank {rank}: left training ({hb['state']})")
                continue
            lines.append(
                f"  rank {rank}: SILENT: sent no dump, last heartbeat {hb.get('age_s', 0):.1f} s "
                f"ago (frozen or dead); at that heartbeat it {_where(hb)}"
            )
            continue
        coords = ", ".join(f"{d} {info['coords'][d]}" for d in DIMS) if info else ""
        label = f"rank {rank} ({coords})" if coords else f"rank {rank}"
        lines.append(f"  {label}: {_where(info)}")
    return printable("\n".join(lines))


def printable(text: str) -> str:
    """`text` with every control character but newline and tab shown as '?': what ranks
    published to the store reaches a terminal and a file, and must not drive either."""
    return "".join(
        c if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cf") else "?" for c in text
    )
