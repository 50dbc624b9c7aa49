"""One step's ledger: its wall time split into categories that add up to it.

From the clock's exclusive seconds (shardwise.distributed.clock): compute (forward, backward,
recomputation), communication the step waited for per mesh dimension (`comm_exposed_s`: dp,
tp, pp, cp and ep), the time async collectives ran behind other work (`comm_overlapped_s`:
shown, not added), pipeline bubble, data, optimizer, checkpoint, evaluation, waiting for a
late rank (`straggler_wait_s`: only a profile, which sees every rank, can tell it from
communication) and the rest (`other_s`: bookkeeping such as memory accounting, and control
all-reduces over all ranks).
"""

from __future__ import annotations

# the mesh dimensions communication is charged to: context parallelism's exchange (cp) and
# expert parallelism's all-to-all (ep) have their own, as in metrics.jsonl's comm_bytes
DIMS = ("dp", "tp", "pp", "cp", "ep")
# sub-groups of a dimension, charged to it: the expert gradients' reduction over the ranks
# holding the same experts (edp) is data-parallel traffic, as comm.py's take_step reports it
_PART_OF = {"edp": "dp"}
# the added parts, in report order (comm_exposed_s is a dict per dim)
PARTS = (
    "compute_s",
    "comm_exposed_s",
    "bubble_s",
    "data_s",
    "optimizer_s",
    "checkpoint_s",
    "eval_s",
    "straggler_wait_s",
    "other_s",
)


_OWN = {"forward", "backward", "recompute", "bubble", "data", "optimizer", "checkpoint", "eval"}


def seconds6(x: float) -> float:
    """Seconds as a ledger stores them: to the microsecond."""
    return round(x, 6)


def build(step_s: float, totals: dict[str, float], overlapped: dict[str, float]) -> dict:
    """The ledger of a span of `step_s` seconds whose clock charged `totals`."""
    r = seconds6
    parts = {k: totals.get(k, 0.0) for k in ("forward", "backward", "recompute")}
    totals, overlapped = _folded(totals, "comm:"), _folded(overlapped, "")
    exposed = {d: r(totals.get(f"comm:{d}", 0.0)) for d in DIMS}
    claimed = _OWN | {f"comm:{d}" for d in DIMS}
    return {
        "step_s": r(step_s),
        "compute_s": r(sum(parts.values())),
        **{f"{k}_s": r(v) for k, v in parts.items()},
        "comm_exposed_s": exposed,
        "comm_overlapped_s": {d: r(overlapped.get(d, 0.0)) for d in DIMS},
        **{f"{k}_s": r(totals.get(k, 0.0)) for k in sorted(_OWN - set(parts))},
        "straggler_wait_s": 0.0,
        "other_s": r(sum(v for k, v in totals.items() if k not in claimed)),
    }


def _folded(seconds: dict[str, float], prefix: str) -> dict[str, float]:
    """`seconds` with each sub-group's key (`prefix` + name) added into its dimension's."""
    out = dict(seconds)
    for sub, dim in _PART_OF.items():
        if prefix + sub in out:
            out[prefix + dim] = out.get(prefix + dim, 0.0) + out.pop(prefix + sub)
    return out


def total(ledger: dict) -> float:
    """The sum of a ledger's added parts (equal to its step_s when nothing is missed); a
    device ledger's `launch_bound_s` (profile/kernels.py) is one of them."""
    out = ledger.get("launch_bound_s", 0.0)
    for key in PARTS:
        value = ledger[key]
        out += sum(value.values()) if isinstance(value, dict) else value
    return out
