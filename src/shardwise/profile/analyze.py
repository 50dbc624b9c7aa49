"""All ranks' captures into one picture: ledgers with straggler waits split off, and one
clock-aligned timeline.

A straggler: every member of a group must enter a collective before any can leave it, so the
member that arrived last waits least; what another member waited beyond that least wait was
spent waiting for the late one, not communicating. Matching the same collective across ranks
(mesh dimension, its index on that dimension, call or async wait; cp and ep over their runs
of a dp line) gives, per rank and step, `straggler_wait_s` taken out of that dimension's
exposed communication (or, for control collectives over all ranks, out of `other_s`),
`waited_for`: the seconds per late rank, and `straggler_by_dim`: the seconds per dimension
(`world` for the control collectives).
Point-to-point pipeline waits are left out: a stage waiting for its neighbour is the bubble.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from shardwise.errors import ShardwiseError
from shardwise.profile import host_syncs

DIMS = ("dp", "tp", "pp")  # the mesh's lines (cp and ep are runs inside a dp line)


def load_parts(folder: Path, world: int) -> tuple[list[dict], list[str]]:
    """Every rank's capture in rank order, and one line for each rank that left none or
    failed to write its trace."""
    parts, problems = [], []
    for rank in range(world):
        path = folder / f"rank{rank}.json"
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            problems.append(f"rank {rank}: no capture ({exc})")
            continue
        if part.get("error"):
            problems.append(f"rank {rank}: {part['error']}")
        parts.append(part)
    if not parts:
        raise ShardwiseError(f"no rank wrote its profile into {folder}: " + "; ".join(problems))
    return parts, problems


def _groups(parts: list[dict], dim: str) -> list[list[int]]:
    """Indices into `parts` of the ranks that share a collective over `dim` ('world': all)."""
    if dim == "world":
        return [list(range(len(parts)))]
    if dim in ("cp", "ep"):  # a run of consecutive dp coordinates: same pp, tp, run start
        if any(dim not in p["coords"] for p in parts):
            return []  # (a capture from before cp/ep coordinates were written)
        runs: dict[tuple, list[int]] = defaultdict(list)
        for i, part in enumerate(parts):
            c = part["coords"]
            runs[(c["pp"], c["tp"], c["dp"] - c[dim])].append(i)
        return list(runs.values())
    others = [d for d in DIMS if d != dim]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, part in enumerate(parts):
        groups[tuple(part["coords"][d] for d in others)].append(i)
    return list(groups.values())


def split_stragglers(parts: list[dict]) -> None:
    """Move waits for late ranks out of each measured step's ledger (in place)."""
    n_steps = min(len(p["steps"]) for p in parts)
    for k in range(n_steps):
        steps = [p["steps"][k] for p in parts]
        waits = [_index(s["waits"]) for s in steps]
        for s in steps:
            s["ledger"]["waited_for"] = {}
            s["ledger"]["straggler_by_dim"] = {}
        for dim in ("dp", "tp", "cp", "ep", "world"):
            for group in _groups(parts, dim):
                if len(group) > 1:
                    _split_group(parts, steps, waits, group, dim)


def _index(waits: list) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    for dim, n, waiting, seconds in waits:
        out[(dim, n, waiting)] = seconds
    return out


def _split_group(parts, steps, waits, group: list[int], dim: str) -> None:
    keys = set.intersection(*(set(k for k in waits[i] if k[0] == dim) for i in group))
    for key in keys:
        seconds = {i: waits[i][key] for i in group}
        late = min(seconds, key=seconds.get)
        floor = seconds[late]
        for i in group:
            excess = seconds[i] - floor
            if i == late or excess <= 0:
                continue
            ledger = steps[i]["ledger"]
            if dim == "world":
                take = min(excess, ledger["other_s"])
                ledger["other_s"] = round(ledger["other_s"] - take, 6)
            else:
                take = min(excess, ledger["comm_exposed_s"][dim])
                ledger["comm_exposed_s"][dim] = round(ledger["comm_exposed_s"][dim] - take, 6)
            ledger["straggler_wait_s"] = round(ledger["straggler_wait_s"] + take, 6)
            by_dim = ledger["straggler_by_dim"]
            by_dim[dim] = round(by_dim.get(dim, 0.0) + take, 6)
            who = str(parts[late]["rank"])
            ledger["waited_for"][who] = round(ledger["waited_for"].get(who, 0.0) + take, 6)


def summary_ranks(parts: list[dict]) -> list[dict]:
    """The contract's `ranks`: per rank, the ledger of every measured step."""
    return [
        {
            "rank": p["rank"],
            "coords": p["coords"],
            **({"host": p["host"]} if "host" in p else {}),
            "steps": [
                {
                    "step": s["step"],
                    **s["ledger"],
                    # CUDA: seconds the device sat idle in each host wait (device events)
                    **({"device_stall_s": s["device_stall_s"]} if "device_stall_s" in s else {}),
                    # CPU time and the training thread's wait for a core (profile/cpu.py)
                    **({"cpu": s["cpu"]} if "cpu" in s else {}),
                }
                for s in p["steps"]
            ],
            # the traced step from the device's kernels (CUDA; profile/kernels.py)
            **({"device_ledger": p["device_ledger"]} if p.get("device_ledger") else {}),
            # what brought values to the host, by call site (profile/host_syncs.py)
            **_host_syncs(p["steps"]),
        }
        for p in parts
    ]


def _host_syncs(steps: list[dict]) -> dict:
    counted = [s["host_syncs"] for s in steps if "host_syncs" in s]
    return {"host_syncs": host_syncs.summary(counted)} if counted else {}


def mean_ledger(ranks: list[dict]) -> dict:
    """Each part's mean over ranks and steps (dicts per dimension averaged key by key)."""
    rows = [s for r in ranks for s in r["steps"]]
    out: dict = {}
    for key, value in rows[0].items():
        if key in ("step", "waited_for", "device_stall_s", "cpu"):
            continue
        if key == "straggler_by_dim":
            dims = {d for row in rows for d in row[key]}
            out[key] = {d: sum(row[key].get(d, 0.0) for row in rows) / len(rows) for d in dims}
            continue
        if isinstance(value, dict):
            out[key] = {d: sum(row[key][d] for row in rows) / len(rows) for d in value}
        else:
            out[key] = sum(row[key] for row in rows) / len(rows)
    return out


def timeline(parts: list[dict]) -> dict:
    """One Chrome/Perfetto trace of every rank's clock intervals: a process per rank, times
    from the barrier all ranks left together (on several machines their clocks differ; the
    barrier aligns them to within its own latency)."""
    events: list[dict] = []
    for p in parts:
        rank = p["rank"]
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for category, start, end in p["events"]:
            events.append(
                {
                    "ph": "X",
                    "name": category,
                    "cat": category.split(":")[0],
                    "pid": rank,
                    "tid": 0,
                    "ts": round(start * 1e6, 3),
                    "dur": round((end - start) * 1e6, 3),
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# the parts the device ledger (kernels, CUDA) gives for a step; straggler waits stay the host's
_DEVICE_PARTS = (
    "compute_s", "forward_s", "backward_s", "recompute_s", "bubble_s", "data_s",
    "optimizer_s", "checkpoint_s", "eval_s", "launch_bound_s", "other_s",
)  # fmt: skip


def device_view(mean: dict, ranks: list[dict]) -> dict:
    """The mean ledger the findings are priced from. On CUDA the host runs ahead of its
    kernels, so the host's split follows launches (a replayed forward costs the host little
    and the device much): there the device's split of the traced step (mean over ranks)
    replaces the host's, fitted to the measured steps' mean: kernel time as traced; the
    device's stall in each host wait as measured in the measured steps (`device_stall_s`,
    device events: the traced step's host, slowed by the profiler, is less far ahead when it
    waits); evaluation and checkpoint as the host measured them (the traced step is the run's
    last, which evaluates and may save; the measured ones need not); the rest of the idle
    device scaled to fill the step. Straggler waits stay the host's (only matching calls
    across ranks finds them; on CUDA a late rank's wait is also inside the NCCL kernels
    kept as traced, so several ranks' slack is counted twice there). Without kernels (CPU):
    `mean` itself."""
    device = [r["device_ledger"] for r in ranks if r.get("device_ledger")]
    if not device:
        return mean
    avg = mean_ledger([{"steps": device}])
    traced_idle = avg.get("idle_s", {})
    given = {k: mean[k] for k in ("eval_s", "checkpoint_s")} | _mean_stalls(ranks)
    idle = {k: v for k, v in traced_idle.items() if k not in given}
    own = avg["step_s"] - sum(avg[k] for k in given)  # the traced parts that are fitted
    busy = own - sum(idle.values())
    target = mean["step_s"] - mean["straggler_wait_s"] - sum(given.values())
    rest, scaled = target - busy, sum(idle.values())
    if rest >= 0 and (scaled > 0 or rest == 0):
        f_busy, f_idle = 1.0, rest / scaled if scaled else 0.0
    else:  # (faster than its kernels as traced: scale all alike)
        f_busy = f_idle = max(0.0, target) / own if own > 0 else 0.0

    def fit(value: float, key: str) -> float:
        if key in given:
            return given[key]
        spent_idle = idle.get(key, 0.0)
        return (value - spent_idle) * f_busy + spent_idle * f_idle

    out = {**mean, "source": "device"}
    for key in _DEVICE_PARTS:
        out[key] = fit(avg[key], key)
    out["comm_exposed_s"] = {
        d: fit(v, f"comm_exposed_s.{d}") for d, v in avg["comm_exposed_s"].items()
    }
    out["comm_overlapped_s"] = {d: v * f_busy for d, v in avg["comm_overlapped_s"].items()}
    return out


def _mean_stalls(ranks: list[dict]) -> dict[str, float]:
    """Mean seconds per step the device stalled in each host wait, as ledger parts
    (`data_s`), over the measured steps of every rank that measured them (CUDA)."""
    steps = [s for r in ranks for s in r["steps"] if "device_stall_s" in s]
    if not steps:
        return {}
    cats = {c for s in steps for c in s["device_stall_s"]}
    return {
        f"{c}_s": sum(s["device_stall_s"].get(c, 0.0) for s in steps) / len(steps) for c in cats
    }
