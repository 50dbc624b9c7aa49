"""What every adapter of the published record shares (published_rows.py, published_moe.py):
the frameworks' `Deviations` (`published/frameworks.toml`), the priced case, and the planner's
pick of the knobs a source does not state."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

from shardwise.plan import search
from shardwise.plan.layout import Job, Layout
from shardwise.plan.peers import NONE, Deviations

HERE = Path(__file__).resolve().parent / "published"


def load_frameworks(path: Path = HERE / "frameworks.toml") -> dict[str, Deviations]:
    """Each framework's `Deviations` from `path`: a table per framework of the fields it sets,
    each `{ value, source }`, and optionally the `base` (a framework above) it starts from."""
    out: dict[str, Deviations] = {}
    known = {f.name for f in dataclasses.fields(Deviations)} - {"name"}
    for name, entry in tomllib.loads(path.read_text()).items():
        sets = {k: v for k, v in entry.items() if k not in ("about", "base")}
        if unknown := sorted(sets.keys() - known):
            raise ValueError(f"{path.name} [{name}]: not a Deviations field: {unknown}")
        if unsourced := sorted(k for k, v in sets.items() if not v.get("source")):
            raise ValueError(f"{path.name} [{name}]: no source for {unsourced}")
        base = out[entry["base"]] if "base" in entry else NONE
        values = {k: v["value"] for k, v in sets.items()}
        out[name] = dataclasses.replace(base, name=name, **values)
    return out


FRAMEWORKS = load_frameworks()


@dataclass
class Case:
    row: dict
    job: Job
    layout: Layout
    measured_s: float  # nan for a run the source says ran out of memory
    oom: bool = False


def best_layout(job: Job, candidates: list[Layout]) -> Layout:
    """For knobs the source does not state (micro-batch, interleaving depth): the planner's
    fastest candidate that fits, as `plan` picks when those keys are not pinned."""
    scored, why = [], set()
    for lay in candidates:
        if reason := search.invalid(job, lay):
            why.add(reason)
            continue
        rec = search.evaluate(job, lay)
        scored.append((search.fits(job, rec) is not None, rec["step_time_s"], lay))
    if not scored:
        raise ValueError(f"the layout is invalid for the planner: {', '.join(sorted(why))}")
    return min(scored, key=lambda x: (x[0], x[1]))[2]
