"""Findings of a profile for the sequence and expert dimensions: exposed context-parallel (cp)
and expert-parallel (ep) communication, and MoE load imbalance (job/remedy.py's vocabulary;
each priced by the planner where it can be, else reported without a predicted gain).
"""

from __future__ import annotations

import math

from shardwise.config import Config, with_overrides
from shardwise.errors import ShardwiseError
from shardwise.job.finding import finding as _finding
from shardwise.job.finding import pct as _pct
from shardwise.job.predict import job_from_config, layout_from_config, predict_config
from shardwise.plan.hardware import Hardware
from shardwise.plan.memory import device_overhead
from shardwise.plan.search import fits
from shardwise.training.validate import derive

# Reported from a worst layer's max/mean expert load of 1.5: the busiest expert's rows set
# the grouped GEMM's time (its rank's experts finish last, and every ep rank waits for them
# at the combine's all-to-all) and the all-to-all's largest split; at 1.5 that expert holds
# half again the rows balanced routing gives it, so a third of the routed experts' time
# (1 - 1/1.5) is the imbalance's. Below it lies what an untrained router shows from its
# random initial logits alone: 1.26-1.38 per layer measured on moe-tiny (4 experts, top-2,
# 1,024 routed rows per step; tests/test_profile_moe.py), not a router that has collapsed.
IMBALANCE = 1.5
# DeepSeek-V3's bias update speed (2024, section 2.1.2) and Switch Transformers' balance
# loss coefficient (Fedus et al. 2021): the remedies' starting values
BIAS_RATE, AUX_COEF = 0.001, 0.01
CAPACITY = 1.25  # Switch Transformers' training capacity factor


def planned(cfg: Config, world: int, hw: Hardware) -> dict | None:
    """The planner's record for `cfg` when it is a valid layout that fits, else None."""
    try:
        d = derive(cfg, world)
        job = job_from_config(cfg, hw, world, d.spec)
        _, rec = predict_config(cfg, d, hw)
        lay = layout_from_config(cfg, d)
    except ShardwiseError:  # (a layout the config checks refuse: not a remedy)
        return None
    rec.setdefault("peak_bytes", rec["mem_bytes"]["total"] + device_overhead(job, lay))
    rec.setdefault("host_bytes", 0)
    # the run's own disk state fits whatever the hardware declares: the job is using it
    return rec if fits(job, rec, disk_budget=math.inf) is None else None


def _rescaled(step: float, exposed: float, key: str, before: dict | None, after: dict | None):
    """The step with the measured exposed time scaled by the planner's ratio of `key` between
    two records (None where either is missing or the first predicts none of it)."""
    if before is None or after is None or not before["time"].get(key):
        return None
    return step - exposed + exposed * after["time"].get(key, 0.0) / before["time"][key]


def exposed_ep(cfg: Config, world: int, exposed: float, comm: dict, hw: Hardware, step: float):
    """ep's all-to-all: a smaller ep, priced by the planner's exposed exchange."""
    p = cfg.parallel
    evidence = (
        f"ranks wait {_pct(exposed, step)} for expert-parallel all-to-alls: "
        f"{comm['comm_bytes']['ep'] / 1e6:.1f} MB in {comm['comm_calls']['ep']:.0f} calls per step"
    )
    if p.ep * p.tp > hw.per_node:  # the exchange leaves the node (plan/moe.py's link)
        evidence += (
            f"; the ep group (ep {p.ep} x tp {p.tp}) spans nodes of {hw.per_node} devices: keep "
            "ep x tp within a node"
        )
    if not cfg.model.capacity_factor:
        evidence += (
            f"; dropless routing: --model.capacity_factor={CAPACITY:g} bounds the largest split "
            "(drops overflow tokens; not priced: the planner prices balanced routing)"
        )
    smaller = p.ep // 2 if p.ep % 2 == 0 else 1
    remedy = [f"--parallel.ep={smaller}"]
    before = planned(cfg, world, hw)
    new = _rescaled(
        step, exposed, "ep_exposed_s", before, planned(with_overrides(cfg, remedy), world, hw)
    )
    if new is None:
        evidence += f"; ep {smaller} does not fit or cannot be priced by the planner"
        return _finding("exposed_ep_communication", evidence, [], step, step)
    evidence += f"; with ep {smaller} the planner predicts the experts' states still fit"
    return _finding("exposed_ep_communication", evidence, remedy, step, new)


def exposed_cp(cfg: Config, world: int, exposed: float, comm: dict, hw: Hardware, step: float):
    """cp's exchange: the other cp_mode where the planner predicts less exposed exchange."""
    p = cfg.parallel
    evidence = (
        f"ranks wait {_pct(exposed, step)} for context-parallel exchanges (cp {p.cp}, "
        f"{p.cp_mode}): {comm['comm_bytes']['cp'] / 1e6:.1f} MB in "
        f"{comm['comm_calls']['cp']:.0f} calls per step"
    )
    if p.cp > 2:  # (cp 2 -> 1 is no context parallelism: a memory decision, not a speed one)
        evidence += (
            f"; a smaller cp (--parallel.cp={p.cp // 2}) exchanges less but computes more of "
            "each sequence per rank, which the ledger does not split from compute: not priced"
        )
    other = "ulysses" if p.cp_mode == "ring" else "ring"
    remedy = [f"--parallel.cp_mode={other}"]
    before = planned(cfg, world, hw)
    new = _rescaled(
        step, exposed, "cp_exposed_s", before, planned(with_overrides(cfg, remedy), world, hw)
    )
    if new is None or new >= step:
        evidence += (
            f"; the planner predicts no less exposed exchange with {other} (or it does not fit)"
        )
        return _finding("exposed_cp_communication", evidence, [], step, step)
    # the attention's own compute taken as unchanged by the mode (the exchange is what moves)
    evidence += f"; {other} priced by the planner's exposed exchange of both modes"
    return _finding("exposed_cp_communication", evidence, remedy, step, new)


def load_imbalance(cfg: Config, moe: dict, step: float) -> dict | None:
    """`expert_load_imbalance` when the worst layer's mean max/mean load over the measured
    steps is >= IMBALANCE (None otherwise, or without MoE statistics). Not priced: the planner
    prices balanced routing only (plan/moe.py), so no predicted gain is given."""
    loads = moe.get("load_max_mean") or []
    if not loads or max(loads) < IMBALANCE:
        return None
    worst = max(range(len(loads)), key=loads.__getitem__)
    dropped = moe.get("dropped")
    evidence = (
        f"MoE layer {worst}'s busiest expert receives {loads[worst]:.2f}x the mean expert load "
        f"(mean over the measured steps; {IMBALANCE:g}x or more is reported)"
    )
    if dropped is not None:
        evidence += f", {dropped[worst]:.0f} token assignment(s) dropped per step there"
    evidence += (
        "; it sets the grouped GEMM's time and the all-to-all's largest split. Gain not "
        "priced: the planner prices balanced routing only (plan/moe.py)"
    )
    if not moe.get("balance", dropped is not None):  # (a transformers model's own routers)
        evidence += "; the model's own router has no balancing of ours to turn on"
        return _finding("expert_load_imbalance", evidence, [], step, step)
    t = cfg.train
    options = [
        [f"--train.moe_bias_balance={BIAS_RATE:g}"] if not t.moe_bias_balance else [],
        [f"--train.moe_aux_loss={AUX_COEF:g}"] if not t.moe_aux_loss else [],
        [f"--model.capacity_factor={CAPACITY:g}"] if not cfg.model.capacity_factor else [],
    ]
    options = [o for o in options if o]
    found = _finding("expert_load_imbalance", evidence, options[0] if options else [], step, step)
    if not options:
        found["evidence"] += "; balancing and a capacity are already on: a higher bias rate"
    return {**found, "alternatives": options[1:], "layer": worst, "load_max_mean": loads[worst]}
