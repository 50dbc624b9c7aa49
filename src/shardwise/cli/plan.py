"""`shardwise plan`: predict every layout of a job on some hardware and rank them.

    shardwise plan [CONFIG.toml] [--section.key=value ...] [--hardware NAME] [--devices N |
                   --nodes K] [--model NAME|config.json] [--params N] [--top K] [--json]
                   [--explain N] [--print-command N] [--verify]

The model, sequence length, global batch, precision and fine-tuning (finetune.*, optim.name)
come from the config (as for `train`: one source of truth, so `explain` and `train` agree);
`--params N` without an architecture plans model states only (the ZeRO paper's accounting).
Memory is printed in GiB (2^30 bytes), the unit device memory is sold in."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from shardwise.config import Config, load_config, load_toml, parse_overrides
from shardwise.errors import ConfigError
from shardwise.models.families import family_of
from shardwise.plan import moe, report
from shardwise.plan.hardware import GiB, Hardware, detect_hardware, get_hardware
from shardwise.plan.layout import Job
from shardwise.plan.search import nothing_fits, search
from shardwise.plan.states import states_only

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
        "--print-command",
        type=int,
        default=None,
        metavar="N",
        help="print the `shardwise train` command that runs candidate N",
    )
    p.add_argument(
        "--verify", action="store_true", help="run the best candidates here: predicted vs measured"
    )
    p.add_argument("--misses", type=int, default=0, help="also show the K closest misses")
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return p


# beyond any machine built (the largest runs span ~10^5 devices); the search factorises the
# count, so the bound keeps that (trial division to its square root) quick too
MAX_DEVICES = 2**24


def _devices(args, hw: Hardware) -> int:
    if args.devices is not None and args.devices < 1:
        raise ConfigError(f"--devices={args.devices} must be >= 1. Fix: --devices 8")
    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes={args.nodes} must be >= 1. Fix: --nodes 1")
    if args.nodes is not None or args.devices is not None:
        n = args.nodes * hw.per_node if args.nodes is not None else args.devices
        if n > MAX_DEVICES:
            given = f"--nodes={args.nodes}" if args.nodes is not None else f"--devices={n}"
            raise ConfigError(
                f"{given} plans {n:,} devices, more than the planner's limit of "
                f"{MAX_DEVICES:,} (2^24). Fix: --devices 1024 (or the count you have)."
            )
        return n
    from shardwise.distributed.device import local_device_count

    return local_device_count()


@dataclass
class Planned:
    """What `plan` prices, and what it was given: the config and its overrides (the model's
    name included, the hardware's taken out) make the `train` command of a candidate."""

    job: Job
    cfg: Config
    overrides: list[str]


def build_job(args, overrides: list[str]) -> Planned:
    from shardwise.job.predict import job_from_config
    from shardwise.plan.hardware import take_hardware_overrides, with_overrides
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
        job = Job(None, hw, devices, precision="bf16", reduce="bf16", params=int(args.params))
        return Planned(job, cfg, overrides)
    spec = resolve_model(args.model) if args.model and not named else None
    if named:
        resolve_model(args.model)  # an unknown name: the message that lists the presets
    job = dataclasses.replace(
        job_from_config(cfg, hw, devices, spec), pinned=pinned_layout(cfg, overrides)
    )
    family = family_of(job.spec)
    if not family.sized and not family.from_checkpoint:  # no blocks the search can price
        raise ConfigError(
            f"shardwise plan searches the layouts of transformer models; model.name="
            f"'{cfg.model.name}' has no layout but data parallelism and ZeRO to search. Fix: "
            "`shardwise explain` with the same config and --nproc N predicts its memory per rank."
        )
    if family.from_checkpoint or moe.is_moe(job.spec):  # no formula models its blocks (an
        # MoE decoder's activations: measured on its fake model)
        from shardwise.job.real import real_job

        job = real_job(job, cfg)
    return Planned(job, cfg, overrides)


# config key -> the Layout field it pins in the search (sequence parallelism is not a pin: the
# search always runs it with tp > 1, Korthikanti et al. 2022)
PINS = {
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.zero": "zero",
    "parallel.pp_schedule": "pp_schedule",
    "parallel.pp_virtual": "pp_virtual",
    "parallel.grad_compression": "compression",
    "parallel.cp": "cp",
    "parallel.cp_mode": "cp_mode",
    "parallel.ep": "ep",
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


_PINNED = "other than the layout keys given"  # plan/search.invalid's reason for a pin


def nothing_valid(job: Job, result) -> ConfigError | None:
    """When no layout was valid at all (none was even priced), why: the layout keys given or
    the job rule every layout out, which "no layout fits" (memory) would misreport."""
    if result.candidates or result.unfit:
        return None
    keys = {f: k for k, f in PINS.items()}
    given = ", ".join(f"{keys[f]}={v}" for f, v in job.pinned)
    why = [f"{r} ({n:,})" for r, n in result.rejected.most_common(3) if r != _PINNED]
    if why:
        what = f"the layouts with {given}" if given else "all layouts"
        reason = f"{what} were refused: {'; '.join(why)}"
    else:
        n = job.spec.n_experts
        experts = f" and of model.n_experts={n}" if n else " (> 1 only with routed experts)"
        reason = (
            f"the search builds no layout with {given}: tp and cp are powers of two dividing "
            "the devices (tp within a node; cp > 1 only with tp = pp = 1, for a model whose "
            f"attention shardwise splits), pp a divisor, ep a divisor of dp*cp{experts}"
        )
    fix = (
        f"values {job.devices} devices allow, or leave {given} out (plan then searches them)"
        if given
        else "a job those reasons allow (global batch, model sizes), or other --devices"
    )
    return ConfigError(
        f"no valid layout on {job.devices} x {job.hardware.name}: {reason}. Fix: {fix}."
    )


def states_records(job: Job) -> list[dict]:
    rows = []
    for zero in range(4):
        mem = states_only(job.params, job, job.devices, zero)
        rows.append(
            {"zero": zero, "dp": job.devices, "mem_bytes": {k: int(v) for k, v in mem.items()}}
        )
    return rows


def public(rec: dict) -> dict:
    """A candidate as `--json` prints it: the prediction and the train flags that run it."""
    out = {k: v for k, v in rec.items() if k != "device_memory"}
    out["train_flags"] = report.train_flags(rec)
    return out


# the job's data settings: planned at the config defaults when not given, which are sized for
# the tiny preset (seq_len 128, global batch 16, fp32), so `plan` says so
DATA_KEYS = {
    "data.seq_len": ("seq_len", "--data.seq_len=2048"),
    "train.global_batch": ("global batch", "--train.global_batch=512"),
    "precision.compute": ("precision", "--precision.compute=bf16"),
}


def defaulted(config: str | None, overrides: list[str]) -> list[str]:
    """The DATA_KEYS neither the config file nor the command line set."""
    given = {key for key, _ in parse_overrides(overrides)}
    if config is not None:
        for section, values in load_toml(config).items():
            if isinstance(values, dict):
                given |= {f"{section}.{name}" for name in values}
    return [key for key in DATA_KEYS if key not in given]


def header(planned: Planned, fit: int, assumed: list[str]) -> str:
    """The plan's first line: the model, the hardware and the job's data settings, each set
    to its config default marked '(default)'."""
    from shardwise.plan.shapes import param_count

    job, hw = planned.job, planned.job.hardware
    mark = {key: " (default)" if key in assumed else "" for key in DATA_KEYS}
    return (
        f"plan: {param_count(job.spec) / 1e6:,.1f}M params, {job.spec.n_layers} layers x "
        f"{job.spec.dim} wide on {job.devices} x {hw.name} "
        f"({hw.memory / GiB:.1f} GiB, {hw.calibrated}); seq_len {job.seq_len}"
        f"{mark['data.seq_len']}, global batch {job.global_batch}{mark['train.global_batch']}, "
        f"{job.precision}{mark['precision.compute']}; {fit:,} layouts fit; memory in GiB"
    )


def defaults_warning(planned: Planned, assumed: list[str]) -> str | None:
    """One line when the data settings planned are the config defaults, with the fix."""
    if not assumed:
        return None
    job = planned.job
    values = {
        "data.seq_len": job.seq_len,
        "train.global_batch": job.global_batch,
        "precision.compute": job.precision,
    }
    what = ", ".join(f"{DATA_KEYS[k][0]} {values[k]}" for k in assumed)
    fix = " ".join(DATA_KEYS[k][1] for k in assumed)
    return (
        f"warning: {what} planned from the config defaults (sized for the tiny preset), not "
        f"this job's. Fix: give the job's own, e.g. {fix}"
    )


def train_command(args, planned: Planned, rec: dict) -> str:
    """The `shardwise train` command running candidate `rec`: the config file and the
    overrides given here (the layout keys replaced by the candidate's), on its devices."""
    parts = ["shardwise", "train"] + ([args.config] if args.config else [])
    parts += [f"--{k}={v}" for k, v in parse_overrides(planned.overrides) if k not in PINS]
    if args.model and not any(k == "model.name" for k, _ in parse_overrides(planned.overrides)):
        # a config.json: train reads the sizes from its folder (weights beside it)
        if family_of(planned.job.spec).from_checkpoint:
            parts.append("--model.name=hf")
        parts.append(f"--model.init_from={Path(args.model).parent}")
    parts += report.train_flags(rec)
    hw, n = planned.job.hardware, planned.job.devices
    if n <= hw.per_node or n % hw.per_node:
        parts.append(f"--nproc={n}")
        return shlex.join(parts)
    # one agent per node (torch elastic): each node passes its own index and node 0's address
    nodes = f"--nnodes={n // hw.per_node} --nproc={hw.per_node}"
    return f"{shlex.join(parts)} {nodes} --node-rank=$NODE_RANK --rdzv=$MASTER_ADDR:29400"


def _pick(option: str, n: int, cands: list[dict]) -> dict:
    if not 1 <= n <= len(cands):
        raise ConfigError(
            f"{option} {n}: there are {len(cands)} candidates. Fix: {option} 1..{len(cands)}."
        )
    return cands[n - 1]


def _states(args, job: Job) -> int:
    if args.print_command is not None:
        raise ConfigError(
            "--print-command needs a model architecture; --params plans model states only. "
            "Fix: --model NAME (or a config with model.name)."
        )
    rows = states_records(job)
    if args.json:
        print(json.dumps({"candidates": rows, "rejected": {}}, indent=2))
    else:
        print(report.states_table(rows, job.params, job.devices))
    return 0


def run(argv: list[str], overrides: list[str]) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.help:
        print(parser().format_help())
        return 0
    if rest:
        raise ConfigError(f"unexpected argument(s) {rest} for plan. Fix: see `shardwise plan -h`.")
    if args.json and args.print_command is not None:
        raise ConfigError(
            "--print-command prints a command and --json a record: one of them. Fix: drop "
            "--print-command (--json lists every candidate's train_flags)."
        )
    planned = build_job(args, overrides)
    job = planned.job
    if job.spec is None:
        return _states(args, job)
    result = search(job)
    hw = job.hardware
    if not result.candidates:
        if args.misses:
            print(report.misses(result.unfit, args.misses, hw.memory, hw.host_memory))
        raise nothing_valid(job, result) or nothing_fits(job, result)
    if args.verify:
        from shardwise.cli.verify import verify

        return verify(job, result.candidates, args.config, overrides, args.top)
    if args.print_command is not None:
        rec = _pick("--print-command", args.print_command, result.candidates)
        print(train_command(args, planned, rec))
        return 0
    assumed = defaulted(args.config, planned.overrides)
    warning = defaults_warning(planned, assumed)
    if args.json:
        if warning:  # stdout stays JSON
            print(warning, file=sys.stderr)
        cands = [public(c) for c in result.candidates[: args.top]]
        print(json.dumps({"candidates": cands, "rejected": dict(result.rejected)}, indent=2))
        return 0
    if args.explain is not None:
        rec = _pick("--explain", args.explain, result.candidates)
        print(report.explain_candidate(rec, args.explain))
        return 0
    print(header(planned, len(result.candidates), assumed))
    from shardwise.job.explain import alignment_warning, cpu_precision_warning

    for line in (
        warning,
        cpu_precision_warning(job.precision, hw),
        alignment_warning(job.spec, job.precision, hw),
    ):
        if line:
            print(line)
    print(report.table(result.candidates, args.top))
    print(report.rejected_lines(dict(result.rejected)))
    if args.misses:
        print(report.misses(result.unfit, args.misses, hw.memory, hw.host_memory))
    return 0
