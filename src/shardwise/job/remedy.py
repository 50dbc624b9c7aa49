"""Findings of a profile: each cause the ledger shows, the config change that removes it, and
the step time that change should give: the planner's time model replayed with the measured
costs (the measured part of the step scaled by the model's ratio between the two configs,
the rest of the step unchanged).

Causes (`cause`, the documented vocabulary): `data_wait`, `exposed_dp_communication`,
`exposed_tp_communication`, `exposed_pp_communication`, `exposed_cp_communication`,
`exposed_ep_communication`, `expert_load_imbalance`, `pipeline_bubble`, `straggler`,
`recompute`, `cpu_contention` (cp, ep and the imbalance: job/remedy_sharded.py),
`host_syncs`. A cause under `SHARE` of the step is not reported (`cpu_contention`: under
`CONTENTION_SHARE`; `expert_load_imbalance`: by its max/mean load, `remedy_sharded.IMBALANCE`;
`host_syncs`: by any call site beyond the engine's own, unpriced).
"""

from __future__ import annotations

import dataclasses
import math

from shardwise.config import Config, with_overrides
from shardwise.job import remedy_sharded as sharded
from shardwise.job.finding import finding as _finding
from shardwise.job.finding import pct as _pct
from shardwise.job.predict import job_from_config, layout_from_config, predict_config
from shardwise.plan import time as tm
from shardwise.plan.hardware import Hardware
from shardwise.plan.memory import device_overhead
from shardwise.plan.search import fits
from shardwise.profile.host_syncs import ENGINE_SITES, is_package_site
from shardwise.training.validate import derive

SHARE = 0.05
# The training thread's wait for a core (profile/cpu.py) is reported from 10 % of the step:
# on a quiet machine a rank's own helper threads (gloo's, data loading) take turns with it
# (measured, 2 ranks on 2 idle cores: 1-2 % of the step on average, one step 7 %).
CONTENTION_SHARE = 0.10
# below this share of its cores used by the job's own ranks, the contending load is another's
OWN_LOAD = 0.5
PREFETCH = 2  # micro-batches loaded ahead: one computing, one more queued


def findings(
    cfg: Config,
    world: int,
    mean: dict,
    ranks: list[dict],
    comm: dict,
    hw: Hardware,
    moe: dict | None = None,
) -> list[dict]:
    """Ranked findings (by predicted gain) from the mean ledger over ranks and steps, the
    per-rank ledgers, the mean measured `comm_calls`/`comm_bytes` per step and, for an MoE
    model, the measured steps' mean expert statistics (`load_max_mean`, `dropped` per layer)."""
    step = mean["step_s"]
    late = _straggler(ranks, step)
    busy = _cpu_contention(cfg, ranks, step)
    out = [f for f in (late, busy) if f is not None]
    if mean["data_s"] >= SHARE * step:
        out.append(_data_wait(cfg, mean, step))
    out += _exposed_communication(cfg, world, mean, comm, hw, step, straggler=late is not None)
    imbalance = sharded.load_imbalance(cfg, moe, step) if moe else None
    if imbalance is not None:
        out.append(imbalance)
    syncs = _host_syncs(ranks, step)
    if syncs is not None:
        out.append(syncs)
    if mean["bubble_s"] >= SHARE * step:
        out.append(_bubble(cfg, world, mean, step))
    if mean["recompute_s"] >= SHARE * step:
        out.append(_recompute(cfg, world, mean, hw, step))
    if busy is not None:  # threads kept off a core also wait longer in collectives
        for f in out:
            if f["cause"] in _WAITS:
                f["evidence"] += (
                    "; part of this wait may be threads waiting for a core (cpu_contention)"
                )
    return sorted(out, key=lambda f: -f["predicted_gain"])


# waits on other ranks or their transport threads, which CPU contention lengthens
_WAITS = {"straggler", *(f"exposed_{d}_communication" for d in ("dp", "tp", "pp", "cp", "ep"))}


def _exposed_communication(
    cfg: Config, world: int, mean: dict, comm: dict, hw: Hardware, step: float, straggler: bool
) -> list[dict]:
    """One finding per mesh dimension (dp, tp, pp, ep, cp in that order) whose collectives
    the ranks wait for >= SHARE of the step."""
    exposed = mean["comm_exposed_s"]
    out = []
    # with no straggler, ranks waiting for each other by turns at the data-parallel
    # collectives is their cost too (jitter at every synchronisation point)
    dp_wait = exposed["dp"]
    if not straggler:
        dp_wait += mean.get("straggler_by_dim", {}).get("dp", 0.0)
    if dp_wait >= SHARE * step:
        out.append(_exposed_dp(cfg, world, dp_wait, comm, hw, step))
    for dim in ("tp", "pp"):
        if exposed[dim] >= SHARE * step:
            out.append(_exposed_unremedied(dim, exposed[dim], comm, step))
    if exposed.get("ep", 0.0) >= SHARE * step:
        out.append(sharded.exposed_ep(cfg, world, exposed["ep"], comm, hw, step))
    if exposed.get("cp", 0.0) >= SHARE * step:
        out.append(sharded.exposed_cp(cfg, world, exposed["cp"], comm, hw, step))
    return out


def _exposed_unremedied(dim: str, exposed: float, comm: dict, step: float) -> dict:
    """A tp or pp collective wait, with its traffic as evidence and no config remedy."""
    return _finding(
        f"exposed_{dim}_communication",
        f"ranks wait {_pct(exposed, step)} for {dim} collectives; "
        f"{dim} traffic {comm['comm_bytes'][dim] / 1e6:.1f} MB in "
        f"{comm['comm_calls'][dim]:.0f} calls per step",
        [],
        step,
        step,
    )


def _data_wait(cfg: Config, mean: dict, step: float) -> dict:
    data = mean["data_s"]
    # loaded in threads behind the rest of the step: the step takes the longer of the two
    new = max(step - data, data)
    remedy = [f"--data.prefetch={max(PREFETCH, cfg.data.prefetch + 1)}"]
    if cfg.parallel.pp > 1:
        remedy = []  # the pipeline loads its own micro-batches
    return _finding(
        "data_wait",
        f"the step waits for its batches {_pct(data, step)}",
        remedy,
        step,
        new if remedy else step,
    )


def _exposed_dp(cfg: Config, world: int, exposed: float, comm: dict, hw: Hardware, step: float):
    calls, sent = comm["comm_calls"]["dp"], comm["comm_bytes"]["dp"]
    evidence = (
        f"ranks wait {_pct(exposed, step)} for data-parallel collectives: "
        f"{sent / 1e6:.1f} MB in {calls:.0f} calls per step"
    )
    default = 25.0
    if cfg.parallel.zero == 0 and cfg.parallel.bucket_mb < default:
        remedy = [f"--parallel.bucket_mb={default:g}"]
        predicted = _calls(cfg, world, hw), _calls(with_overrides(cfg, remedy), world, hw)
        new_calls = max(1.0, calls - (predicted[0] - predicted[1]))
        # alpha-beta (Hockney): each call pays the latency, each byte the bandwidth; the
        # measured exposed time scaled by the model's ratio for the fewer calls
        cost = lambda c: c * hw.latency + sent / hw.intra_bw  # noqa: E731
        new = step - exposed + exposed * cost(new_calls) / cost(calls)
        evidence += f" (bucket_mb={cfg.parallel.bucket_mb:g}: {predicted[0]} buckets)"
        return _finding("exposed_dp_communication", evidence, remedy, step, new)
    p = cfg.parallel
    if p.grad_compression == "none" and cfg.precision.reduce == "fp32":
        # the same calls with half the bytes: a bf16 wire (parallel/compress.py) rounds each
        # summed gradient once; PowerSGD would send less still, but approximates
        remedy = ["--parallel.grad_compression=bf16"]
        cost = lambda b: calls * hw.latency + b / hw.intra_bw  # noqa: E731
        new = step - exposed + exposed * cost(sent / 2) / cost(sent)
        evidence += "; a bf16 wire sends half (powersgd: a low-rank share, approximate)"
        return _finding("exposed_dp_communication", evidence, remedy, step, new)
    return _finding("exposed_dp_communication", evidence, [], step, step)


def _bubble(cfg: Config, world: int, mean: dict, step: float) -> dict:
    d = derive(cfg, world)
    local = cfg.train.global_batch // d.dp
    m, p = local // d.micro_batch, cfg.parallel.pp
    bubble = mean["bubble_s"]
    evidence = f"pipeline stages idle {_pct(bubble, step)} with {m} micro-batch(es) over {p} stages"
    # twice the micro-batches (the next count that divides the local batch): one step at a
    # time, because halving a micro-batch also makes it run less efficiently, which the
    # prediction below does not count; a profile of the remedied job prices the next step
    target = next((k for k in range(2 * m, local + 1) if local % k == 0), None)
    if target is None:
        return _finding("pipeline_bubble", evidence, [], step, step)
    remedy = [f"--train.micro_batch={local // target}"]
    # the planner's bubble (plan/time.py): idle slots per step (p-1 for 1F1B/GPipe, fewer
    # interleaved) x one micro-batch's time; the same work in `target` micro-batches makes
    # each m/target as long, and the measured bubble shrinks by that ratio (compute taken
    # as unchanged)
    return _finding("pipeline_bubble", evidence, remedy, step, step - bubble * (1 - m / target))


def _recompute(cfg: Config, world: int, mean: dict, hw: Hardware, step: float) -> dict:
    spent = mean["recompute_s"]
    evidence = f"recomputation (memory.recompute={cfg.memory.recompute}) takes {_pct(spent, step)}"
    for mode in ("none", "selective"):
        if mode == cfg.memory.recompute or (mode == "selective" and cfg.memory.recompute != "full"):
            continue
        remedy = [f"--memory.recompute={mode}"]
        other = with_overrides(cfg, remedy)
        d = derive(other, world)
        job = job_from_config(other, hw, world, d.spec)
        _, rec = predict_config(other, d, hw)
        lay = layout_from_config(other, d)
        rec.setdefault("peak_bytes", rec["mem_bytes"]["total"] + device_overhead(job, lay))
        rec.setdefault("host_bytes", 0)
        # the run's own disk state (memory.offload=...+nvme; recomputation does not change
        # it) fits whatever the hardware declares: the job is using it
        if fits(job, rec, disk_budget=math.inf) is None:
            # none: the replayed forwards go; selective keeps the planner's share of them
            full = tm.hardware_flops_per_token(job, dataclasses.replace(lay, recompute="full"))
            base = tm.hardware_flops_per_token(job, dataclasses.replace(lay, recompute="none"))
            kept = (tm.hardware_flops_per_token(job, lay) - base) / max(full - base, 1e-9)
            peak = rec["mem_bytes"]["total"] / 1e6
            evidence += f"; with {mode} the planner predicts {peak:.0f} MB per rank, which fits"
            return _finding("recompute", evidence, remedy, step, step - spent * (1 - kept))
    return _finding("recompute", evidence + "; nothing less fits", [], step, step)


def _straggler(ranks: list[dict], step: float) -> dict | None:
    """The rank the others wait for most, when they wait for it >= SHARE of the step more
    than it waits for them (ranks on a busy machine wait for each other by turns)."""
    waited: dict[int, float] = {}  # mean per step the others waited for each rank
    own: dict[int, float] = {}  # mean per step each rank waited for the others
    for r in ranks:
        n = len(r["steps"]) or 1
        own[r["rank"]] = sum(s["straggler_wait_s"] for s in r["steps"]) / n
        for s in r["steps"]:
            for who, sec in s.get("waited_for", {}).items():
                waited[int(who)] = waited.get(int(who), 0.0) + sec / n / (len(ranks) - 1)
    if not waited:
        return None
    late = max(waited, key=waited.get)
    net = waited[late] - own.get(late, 0.0)
    if net < SHARE * step or waited[late] < 2 * own.get(late, 0.0):
        return None  # (jitter: ranks that wait for each other by turns)
    evidence = (
        f"rank {late} arrives late: the others wait for it {_pct(waited[late], step)}, it "
        f"waits for them {own.get(late, 0.0) * 1e3:.1f} ms; its host is slower (other load, "
        "throttling, a slower device or link) or it does more work"
    )
    # if it kept pace, the others would not wait: no config change does that
    return {**_finding("straggler", evidence, [], step, step - net), "rank": late}


def _cpu_contention(cfg: Config, ranks: list[dict], step: float) -> dict | None:
    """The rank whose training thread waited longest for a core while ready to run, when that
    wait is >= CONTENTION_SHARE of the step (None where no rank's wait was measured)."""
    use: dict[int, dict[str, float]] = {}
    for r in ranks:
        cpu = [s["cpu"] for s in r["steps"] if s.get("cpu", {}).get("run_wait_s") is not None]
        if cpu:
            use[r["rank"]] = {k: sum(c[k] for c in cpu) / len(cpu) for k in _CPU_KEYS}
    if not use:
        return None
    worst = max(use, key=lambda k: use[k]["run_wait_s"])
    u = use[worst]
    if u["run_wait_s"] < CONTENTION_SHARE * step or not u["wall_s"]:
        return None
    ratio = round(u["thread_cpu_s"] / u["wall_s"], 2)
    # the job's own demand: CPU-s per s of every rank on the worst rank's host, against the
    # host's cores the job may use (pinned ranks each see their own share of them)
    host = next(r.get("host") for r in ranks if r["rank"] == worst)
    mates = [r["rank"] for r in ranks if r.get("host") == host and r["rank"] in use]
    own = sum(use[k]["process_cpu_s"] / use[k]["wall_s"] for k in mates)
    pinned = cfg.run.cpu_affinity == "cores"
    cores = (sum if pinned else max)(use[k]["cores"] for k in mates) or 1
    evidence = (
        f"rank {worst}'s training thread waited for a core {_pct(u['run_wait_s'], step)} while "
        f"ready to run: it ran {u['thread_cpu_s'] * 1e3:.1f} ms of each step (CPU/wall "
        f"{ratio:.2f}); the job's {len(mates)} rank(s) on its host "
        f"used {own:.1f} of its {cores:.0f} core(s)"
    )
    if own < OWN_LOAD * cores:
        evidence += ": the rest went to other processes; run where they are not"
        remedy = []  # another job's load is no config value
    else:
        evidence += ": fewer ranks (--nproc) or threads (OMP_NUM_THREADS) per core"
        remedy = [] if pinned else ["--run.cpu_affinity=cores"]
        if remedy:
            evidence += ", or pin each rank to its own cores"
    # given the cores, the thread would have run instead of waiting (the others wait for the
    # slowest rank at the next collective, so its wait is the step's)
    found = _finding("cpu_contention", evidence, remedy, step, step - u["run_wait_s"])
    return {**found, "rank": worst, "cpu_wall_ratio": ratio}


_CPU_KEYS = ("wall_s", "process_cpu_s", "thread_cpu_s", "run_wait_s", "cores")


def _host_syncs(ranks: list[dict], step: float) -> dict | None:
    """`host_syncs` when a rank's measured steps read values to the host at call sites
    beyond the engine's own (profile/host_syncs.py), with the most per step any rank made
    at each; None where none did. Not priced: the planner's time model has no host syncs."""
    extra: dict[str, float] = {}
    for r in ranks:
        for site, n in r.get("host_syncs", {}).get("unexpected", {}).items():
            extra[site] = max(extra.get(site, 0.0), n)
    if not extra:
        return None
    sites = dict(sorted(extra.items(), key=lambda kv: (-kv[1], kv[0])))
    yours = {s: n for s, n in sites.items() if not is_package_site(s)}
    ours = {s: n for s, n in sites.items() if s not in yours}
    parts = [f"outside shardwise (your model or loss, or a library they call): {_listed(yours)}"]
    parts = parts if yours else []
    parts += [f"in shardwise's own code (no setting removes them): {_listed(ours)}"] if ours else []
    evidence = (
        f"{sum(extra.values()):g} host sync(s) per step beyond the engine's own "
        f"({', '.join(ENGINE_SITES)}): " + "; ".join(parts) + ". Each makes the host wait for the "
        "device's queued work (on an accelerator its launches stop running ahead of the "
        "kernels): keep such values on the device or read them every few steps. Gain not "
        "priced: the planner's time model has no host syncs"
    )
    return {**_finding("host_syncs", evidence, [], step, step), "sites": sites}


def _listed(sites: dict[str, float]) -> str:
    return ", ".join(f"{s} ({n:g} per step)" for s, n in sites.items())


def _calls(cfg: Config, world: int, hw: Hardware) -> int:
    d = derive(cfg, world)
    return predict_config(cfg, d, hw)[1]["comm_calls"]["dp"]
