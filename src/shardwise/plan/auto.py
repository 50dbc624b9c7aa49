"""`train --plan auto`: the best feasible layout for the detected hardware and world size."""

from __future__ import annotations

import copy

from shardwise.config import Config
from shardwise.errors import NotYetSupportedError
from shardwise.plan.hardware import detect_hardware
from shardwise.plan.predict import job_from_config
from shardwise.plan.search import nothing_fits, search


def apply_layout(cfg: Config, cand: dict) -> Config:
    """A copy of `cfg` running candidate `cand` (degrees, schedule, micro-batch, memory)."""
    out = copy.deepcopy(cfg)
    p = out.parallel
    p.tp, p.pp, p.zero, p.sp = cand["tp"], cand["pp"], cand["zero"], cand["sp"]
    p.pp_schedule, p.pp_virtual = cand["pp_schedule"], cand["pp_virtual"]
    out.train.micro_batch = cand["micro_batch"]
    out.memory.recompute, out.memory.offload = cand["recompute"], cand["offload"]
    return out


def auto_config(cfg: Config, nproc: int) -> Config:
    """Search, then take the best candidate this version of the engine can run; print it."""
    from shardwise.training.validate import derive

    hw = detect_hardware()
    job = job_from_config(cfg, hw, nproc)
    result = search(job)
    if not result.candidates:
        raise nothing_fits(job, result)
    skipped = 0
    for cand in result.candidates:
        chosen = apply_layout(cfg, cand)
        try:
            derive(chosen, nproc)
        except NotYetSupportedError:  # e.g. a tp/pp layout before that engine has landed
            skipped += 1
            continue
        print(
            f"shardwise: --plan auto on {nproc} x {hw.name}: tp={cand['tp']} pp={cand['pp']} "
            f"dp={cand['dp']} zero={cand['zero']} micro_batch={cand['micro_batch']} "
            f"recompute={cand['recompute']} offload={cand['offload']} | predicted "
            f"{cand['step_time_s']:.3g} s/step, {cand['tokens_per_s']:,.0f} tokens/s, "
            f"peak {cand['peak_bytes'] / 1e9:.2f} GB/rank"
            + (f" ({skipped} faster layouts need features not in this version)" if skipped else ""),
            flush=True,
        )
        return chosen
    raise NotYetSupportedError(
        "--plan auto: every layout that fits needs a feature this version does not support. "
        "Fix: pass the layout explicitly."
    )
