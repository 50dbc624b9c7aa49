"""`shardwise plan`: predict every layout of a job on some hardware and rank them.

    shardwise plan [CONFIG.toml] [--section.key=value ...] [--hardware NAME] [--devices N |
                   --nodes K] [--model NAME|config.json] [--params N] [--top K] [--json]
                   [--explain N] [--verify]

The model, sequence length, global batch, precision and fine-tuning (finetune.*, optim.name)
come from the config (as for `train`: one source of truth, so `explain` and `train` agree);
`--params N` without an architecture plans model states only (the ZeRO paper's accounting)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.plan import report
from shardwise.plan.hardware import Hardware, detect_hardware, get_hardware
from shardwise.plan.layout import Job
from shardwise.plan.memory import states_only
from shardwise.plan.search import nothing_fits, search

DESCRIPTION = (
    "Predict memory by category and step time of every layout of a job on some hardware and "
    "rank them by tokens/s. The model, sequence length, global batch and precision come from "
    "the config (as for `train`); --params without an architecture plans model states only."
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwise plan",
        add_help=False,
        usage="%(prog)s [CONFIG.toml] [--section.key=value ...] [options]",
        description=DESCRIPTION,
    )
    p.add_argument("config", nargs="?", default=None, help="TOML config (model, data, batch)")
    p.add_argument("--hardware", default=None, help="catalog name or cpu (default: detected)")
    p.add_argument("--devices", type=int, default=None, help="total devices (ranks)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (devices = nodes x per node)")
    p.add_argument("--model", default=None, help="named model or a Hugging Face config.json")
    p.add_argument("--params", type=float, default=None, help="parameter count: states only")
    p.add_argument("--top", type=int, default=5, help="how many of the best layouts to show")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--explain", type=int, default=None, metavar="N", help="every term of candidate N's row"
    )
    p.add_argument(
        "--verify", action="store_true", help="run the best candidates here: predicted vs measured"
    )
    p.add_argument("--misses", type=int, default=0, help="also show the K closest misses")
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return p


def _devices(args, hw: Hardware) -> int:
    if args.devices is not None and args.devices < 1:
        raise ConfigError(f"--devices={args.devices} must be >= 1. Fix: --devices 8")
    if args.nodes is not None:
        if args.nodes < 1:
            raise ConfigError(f"--nodes={args.nodes} must be >= 1. Fix: --nodes 1")
        return args.nodes * hw.per_node
    if args.devices is not None:
        return args.devices
    from shardwise.distributed.device import local_device_count

    return local_device_count()


def build_job(args, overrides: list[str]) -> Job:
    from shardwise.plan.hardware import take_hardware_overrides, with_overrides
    from shardwise.plan.predict import job_from_config
    from shardwise.plan.shapes import resolve_model

    hw_args, overrides = take_hardware_overrides(overrides)
    hw = get_hardware(args.hardware) if args.hardware else detect_hardware()
    hw = with_overrides(hw, hw_args)
    devices = _devices(args, hw)
    named = args.model and not (args.model.endswith(".json") or Path(args.model).is_file())
    if named:  # a preset: as --model.name, so --model.* overrides (in any order) still apply
        overrides = [f"--model.name={args.model}", *overrides]
    cfg = load_config(args.config, overrides)
    shaped = [o.split("=")[0] for o in overrides if o.startswith("--model.") and "name" not in o]
    if args.model and not named and shaped:
        raise ConfigError(
            f"--model {args.model} takes every size from that config.json, and "
            f"{', '.join(shaped)} would be ignored. Fix: edit the config.json, or plan a preset "
            "with --model.name and those overrides."
        )
    if args.params is not None:
        if args.params < 1:
            raise ConfigError(f"--params={args.params:g} must be positive. Fix: --params 7.5e9")
        # mixed-precision Adam as in the ZeRO paper: 16-bit parameters and gradients
        return Job(None, hw, devices, precision="bf16", reduce="bf16", params=int(args.params))
    spec = resolve_model(args.model) if args.model and not named else None
    if named:
        resolve_model(args.model)  # an unknown name: the message that lists the presets
    job = dataclasses.replace(
        job_from_config(cfg, hw, devices, spec), pinned=pinned_layout(cfg, overrides)
    )
    if spec is not None and spec.arch == "hf":  # a family the formula does not model
        from shardwise.plan.real import real_job

        job = real_job(job, cfg)
    return job


# config key -> the Layout field it pins in the search (sequence parallelism is not a pin: the
# search always runs it with tp > 1, Korthikanti et al. 2022)
PINS = {
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.zero": "zero",
    "parallel.pp_schedule": "pp_schedule",
    "parallel.pp_virtual": "pp_virtual",
    "parallel.grad_compression": "compression",
    "train.micro_batch": "micro_batch",
    "memory.recompute": "recompute",
    "memory.offload": "offload",
}


def pinned_layout(cfg, overrides: list[str]) -> tuple:
    """The layout fields the user fixed (on the command line, or away from the default in the
    config file): the search keeps only layouts that have them."""
    from shardwise.config import Config

    given = {o[2:].split("=", 1)[0] for o in overrides if o.startswith("--")}
    default = Config()
    out = []
    for key, field in PINS.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if key in given or value != getattr(getattr(default, section), name):
            if key == "train.micro_batch" and not value:  # 0: chosen per layout
                continue
            out.append((field, value))
    return tuple(out)


def states_records(job: Job) -> list[dict]:
    rows = []
    for zero in range(4):
        mem = states_only(job.params, job, job.devices, zero)
        rows.append(
            {"zero": zero, "dp": job.devices, "mem_bytes": {k: int(v) for k, v in mem.items()}}
        )
    return rows


def public(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "device_memory"}


def run(argv: list[str], overrides: list[str]) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.help:
        print(parser().format_help())
        return 0
    if rest:
        raise ConfigError(f"unexpected argument(s) {rest} for plan. Fix: see `shardwise plan -h`.")
    job = build_job(args, overrides)
    if job.spec is None:
        rows = states_records(job)
        if args.json:
            print(json.dumps({"candidates": rows, "rejected": {}}, indent=2))
        else:
            print(report.states_table(rows, job.params, job.devices))
        return 0
    result = search(job)
    if not result.candidates:
        if args.misses:
            print(
                report.misses(
                    result.unfit, args.misses, job.hardware.memory, job.hardware.host_memory
                )
            )
        raise nothing_fits(job, result)
    if args.verify:
        from shardwise.cli.verify import verify

        return verify(job, result.candidates, args.config, overrides, args.top)
    if args.json:
        cands = [public(c) for c in result.candidates[: args.top]]
        print(json.dumps({"candidates": cands, "rejected": dict(result.rejected)}, indent=2))
        return 0
    if args.explain is not None:
        if not 1 <= args.explain <= len(result.candidates):
            raise ConfigError(
                f"--explain {args.explain}: there are {len(result.candidates)} candidates. "
                f"Fix: --explain 1..{len(result.candidates)}."
            )
        print(report.explain_candidate(result.candidates[args.explain - 1], args.explain))
        return 0
    from shardwise.plan.shapes import param_count

    hw = job.hardware
    print(
        f"plan: {param_count(job.spec) / 1e6:,.1f}M params, {job.spec.n_layers} layers x "
        f"{job.spec.dim} wide on {job.devices} x {hw.name} "
        f"({hw.memory / 1e9:.0f} GB, {hw.calibrated}); seq_len {job.seq_len}, global batch "
        f"{job.global_batch}, {job.precision}; {len(result.candidates):,} layouts fit"
    )
    from shardwise.plan.explain import alignment_warning, cpu_precision_warning

    for warning in (
        cpu_precision_warning(job.precision, hw),
        alignment_warning(job.spec, job.precision, hw),
    ):
        if warning:
            print(warning)
    print(report.table(result.candidates, args.top))
    print(report.rejected_lines(dict(result.rejected)))
    if args.misses:
        print(report.misses(result.unfit, args.misses, hw.memory, hw.host_memory))
    return 0
