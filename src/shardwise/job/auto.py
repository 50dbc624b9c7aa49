"""`train --plan auto`: the best feasible layout for the detected hardware and world size."""

from __future__ import annotations

import copy

from shardwise.config import Config
from shardwise.errors import ConfigError, NotYetSupportedError
from shardwise.job.predict import job_from_config, layout_from_config
from shardwise.models.families import family_of
from shardwise.plan.hardware import GB, detect_hardware
from shardwise.plan.memory import device_overhead, kept_in
from shardwise.plan.search import nothing_fits, search


def apply_layout(cfg: Config, cand: dict) -> Config:
    """A copy of `cfg` running candidate `cand` (degrees, schedule, micro-batch, memory)."""
    out = copy.deepcopy(cfg)
    p = out.parallel
    p.tp, p.pp, p.zero, p.sp = cand["tp"], cand["pp"], cand["zero"], cand["sp"]
    p.pp_schedule, p.pp_virtual = cand["pp_schedule"], cand["pp_virtual"]
    out.train.micro_batch = cand["micro_batch"]
    out.memory.recompute, out.memory.offload = cand["recompute"], cand["offload"]
    p.grad_compression = cand.get("compression", "none")  # the search's choice (ZeRO-0 only)
    p.cp, p.cp_mode = cand.get("cp", 1), cand.get("cp_mode", "ring")
    p.ep = cand.get("ep", 1)  # the search's expert-parallel degree (MoE models)
    return out


def auto_config(cfg: Config, nproc: int) -> Config:
    """Search, then take the best candidate this version of the engine can run; print it."""
    from shardwise.training.validate import derive

    hw = detect_hardware()
    job = _planned_job(cfg, hw, nproc)
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
            f"dp={cand['dp']} cp={cand.get('cp', 1)} ep={cand.get('ep', 1)} zero={cand['zero']} "
            f"micro_batch={cand['micro_batch']} "
            f"recompute={cand['recompute']} offload={cand['offload']} "
            f"grad_compression={cand.get('compression', 'none')} | predicted "
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


def _planned_job(cfg: Config, hw, nproc: int):
    """The job the search prices: an MoE decoder's activations measured on its real modules
    (job/real.py), as `shardwise plan` prices it."""
    from shardwise.plan.moe import is_moe

    job = job_from_config(cfg, hw, nproc)
    if is_moe(job.spec) and not family_of(job.spec).from_checkpoint:
        from shardwise.job.real import real_job

        job = real_job(job, cfg)
    return job


def _overrides(cfg: Config, chosen: Config) -> list[str]:
    """The `--key=value` overrides that turn `cfg`'s layout into `chosen`'s."""
    keys = [
        ("parallel", "tp"),
        ("parallel", "pp"),
        ("parallel", "zero"),
        ("parallel", "sp"),
        ("parallel", "pp_schedule"),
        ("parallel", "pp_virtual"),
        ("train", "micro_batch"),
        ("memory", "recompute"),
        ("memory", "offload"),
        ("parallel", "grad_compression"),
        ("parallel", "cp"),
        ("parallel", "cp_mode"),
        ("parallel", "ep"),
    ]
    out = []
    for section, key in keys:
        new = getattr(getattr(chosen, section), key)
        if getattr(getattr(cfg, section), key) != new:
            value = str(new).lower() if isinstance(new, bool) else new
            out.append(f"--{section}.{key}={value}")
    return out


def refuse_if_too_big(cfg: Config, record: dict, nproc: int) -> None:
    """Refuse a job whose plan needs more memory than this machine has (RAM shared by the
    ranks on CPU, each device's memory on GPUs), naming the fastest layout that fits."""
    from shardwise.training.validate import derive

    hw = detect_hardware()
    mem = record["mem_bytes"]
    host = kept_in(mem, "host")
    d = derive(cfg, nproc)
    overhead = device_overhead(job_from_config(cfg, hw, nproc, d.spec), layout_from_config(cfg, d))
    per_rank = mem["total"] + overhead + (host if hw.memory_shared else 0)
    ranks = nproc if hw.memory_shared else 1
    if per_rank * ranks <= hw.memory:
        return
    where = (
        f"{ranks} ranks x {per_rank / GB:.2f} GB = {per_rank * ranks / GB:.2f} GB of this "
        f"machine's {hw.memory / GB:.2f} GB RAM"
        if hw.memory_shared
        else f"{per_rank / GB:.2f} GB per device of {hw.name}'s {hw.memory / GB:.2f} GB"
    )
    fix = "more devices, a smaller model or batch"
    try:
        result = search(job_from_config(cfg, hw, nproc))
        for cand in result.candidates:
            chosen = apply_layout(cfg, cand)
            try:
                derive(chosen, nproc)
            except (ConfigError, NotYetSupportedError):
                continue
            fix = " ".join(_overrides(cfg, chosen)) + (
                f" (the planner's fastest layout that fits: peak {cand['peak_bytes'] / GB:.2f} "
                "GB/rank), or --plan auto"
            )
            break
    except ConfigError:  # a model the search does not cover: the generic advice
        pass
    raise ConfigError(
        f"the plan predicts {where}: the job would run out of memory. Fix: {fix}; or --force "
        "to start anyway."
    )
