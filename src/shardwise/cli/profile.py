"""`shardwise profile`: why is my job slow.

Runs the job (the same code path as `train`) for `profile.warmup` steps, `--steps K` measured
steps and one traced step, every rank, into `run.dir/profile/` (its own metrics.jsonl and
checkpoints: the run's own are never touched or resumed from), then writes there:
`summary.json` (the contract: per rank and step a ledger that adds up to the step's wall
time, and findings ranked by predicted gain), `timeline.json` (every rank's intervals on one
clock), `trace_rank<R>.json` (torch.profiler, Chrome/Perfetto format), `report.md`,
`ledger.png` and `timeline.png`. `--verify-remedy N` then runs finding N's overrides the
same way and prints predicted against measured gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from shardwise.config import Config, load_config, split_overrides, with_overrides
from shardwise.errors import ShardwiseError, print_error

FOLDER = "profile"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwise profile",
        add_help=False,
        usage="%(prog)s [CONFIG.toml] [--nproc N] [--steps K] [--verify-remedy N] "
        "[--section.key=value ...]",
        description="Run a few steps of the job on every rank and say where each step's time "
        "went, per rank, with remedies whose gain is predicted (run.dir/profile/).",
    )
    p.add_argument("config", nargs="?", default=None, help="TOML config; keys as --help-config")
    p.add_argument("--nproc", "--nproc-per-node", dest="nproc", default=None, metavar="N")
    p.add_argument("--steps", default="5", metavar="K", help="measured steps (default 5)")
    p.add_argument(
        "--verify-remedy",
        default=None,
        metavar="N",
        help="then run the N-th finding's remedy and compare predicted with measured gain",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="start even if the plan predicts more memory than this machine has",
    )
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return p


def profile_config(cfg: Config, steps: int, folder: Path) -> Config:
    """The run a profile makes: warm-up + measured + one traced step, in its own folder."""
    out = with_overrides(cfg, [])
    out.profile.steps = steps
    out.train.steps = cfg.profile.warmup + steps + 1
    out.run.dir = str(folder)
    out.checkpoint.dir = ""  # (folder/checkpoints: written only with checkpoint.every)
    out.checkpoint.resume = "none"
    return out


def _writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".shardwise-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ShardwiseError(
            f"cannot write the profile into {folder} ({exc.strerror or exc}). Fix: "
            "--run.dir=<a directory you can write>."
        ) from None


def profile(
    cfg: Config,
    nproc: int,
    folder: Path,
    steps: int,
    hook: str | None = None,
    force: bool = False,
) -> dict:
    """Profile `cfg` on `nproc` local ranks into `folder`; returns the summary. The run is
    prepared (checked, planned, refused if it will not fit) as `shardwise train` prepares it."""
    from shardwise.job import prepare
    from shardwise.launchers.local import launch_local

    _writable(folder)
    pcfg = profile_config(cfg, steps, folder)
    with prepare(pcfg, nproc, force=force) as job:
        for stale in folder.glob("rank*.json"):  # an earlier profile's: never mixed into this one
            stale.unlink()
        launch_local(job.cfg, nproc, hook, derived=job.derived)
    return summarise(pcfg, nproc)


def summarise(pcfg: Config, world: int) -> dict:
    """Every rank's capture in `pcfg.run.dir` into summary.json, timeline.json, the report
    and the findings; prints the ledger table and the top findings."""
    from shardwise.profile.analyze import load_parts
    from shardwise.profile.report import write_report

    folder = Path(pcfg.run.dir)
    parts, problems = load_parts(folder, world)
    summary = _summary(pcfg, world, folder, parts, problems)
    (folder / "timeline.json").write_text(json.dumps(summary["timeline"]))
    write_report(folder, summary, problems)
    del summary["timeline"]
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    _print_summary(folder, summary)
    return summary


def _summary(
    pcfg: Config, world: int, folder: Path, parts: list[dict], problems: list[str]
) -> dict:
    """The profile's summary from every rank's capture (in the run folder `folder`), with the
    merged timeline under `timeline` (written to its own file, not to summary.json)."""
    from shardwise.job.remedy import findings
    from shardwise.plan.hardware import detect_hardware
    from shardwise.profile.analyze import (
        device_view,
        mean_ledger,
        split_stragglers,
        summary_ranks,
        timeline,
    )
    from shardwise.profile.report import STATISTIC

    split_stragglers(parts)
    ranks = summary_ranks(parts)
    comm = _mean_comm(parts)
    trace = timeline(parts)
    priced = device_view(mean_ledger(ranks), ranks)
    measured = {s["step"] for s in parts[0]["steps"]}
    moe = _moe(folder / "metrics.jsonl", measured)
    return {
        "world": world,
        "warmup": pcfg.profile.warmup,
        "measured_steps": pcfg.profile.steps,
        "ranks": ranks,
        "statistic": STATISTIC,  # of the measured steps: the table's, the findings', the MFU's
        # priced from the device's split where there is one (CUDA: profile/kernels.py)
        "findings": findings(pcfg, world, priced, ranks, comm, detect_hardware(), moe),
        "findings_from": priced.get("source", "host"),
        "findings_ledger": priced,  # the mean ledger they were priced from
        "mfu": _mfu(folder / "metrics.jsonl", measured),
        **({"moe": moe} if moe else {}),  # the expert statistics the findings read (MoE)
        "traces": [p["trace"] for p in parts if p["trace"]],
        "problems": problems,
        "timeline": trace,
    }


def _mean_comm(parts: list[dict]) -> dict[str, dict[str, float]]:
    """`comm_calls` and `comm_bytes` per mesh dimension, the mean over every rank's steps."""
    from shardwise.profile.ledger import DIMS

    steps = [s for p in parts for s in p["steps"]]
    return {  # (metrics carry cp and ep only where their degree is > 1)
        key: {d: sum(s[key].get(d, 0) for s in steps) / len(steps) for d in DIMS}
        for key in ("comm_calls", "comm_bytes")
    }


def _print_summary(folder: Path, summary: dict) -> None:
    """The ledger table, the device's and the host syncs' where there are any, the top
    three findings and where the files are."""
    from shardwise.profile.report import device_table, findings_text, host_syncs_text, ledger_table

    print(ledger_table(summary))
    device = device_table(summary)
    if device:
        print(device)
    syncs = host_syncs_text(summary)
    if syncs:
        print(syncs)
    print(findings_text(summary["findings"], top=3))
    print(f"profile: {folder}/summary.json, report.md, timeline.json, trace_rank*.json")


def _mfu(metrics: Path, steps: set[int]) -> float | None:
    """The mean MFU of the measured steps (None where the peak FLOP/s is unknown)."""
    try:
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    except (OSError, ValueError):
        return None
    values = [r["mfu"] for r in records if r.get("step") in steps and r.get("mfu")]
    return statistics.fmean(values) if values else None


def _moe(metrics: Path, steps: set[int]) -> dict | None:
    """The measured steps' mean MoE statistics per layer (training/moe.py's moe_* keys):
    `load_max_mean`, `dropped` (where our balancing runs) and `balance`; None without them."""
    try:
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    except (OSError, ValueError):
        return None
    rows = [r for r in records if r.get("step") in steps and r.get("moe_load_max_mean")]
    if not rows:
        return None

    def mean(key: str) -> list[float]:
        return [round(statistics.fmean(v), 6) for v in zip(*(r[key] for r in rows), strict=True)]

    balance = all("moe_dropped" in r for r in rows)
    return {
        "load_max_mean": mean("moe_load_max_mean"),
        **({"dropped": mean("moe_dropped")} if balance else {}),
        "balance": balance,
    }


def step_s(summary: dict) -> float:
    """The measured step time: the mean over ranks and measured steps, the step the ledger
    table shows and the findings are priced from (`STATISTIC`: a mean, because the ledger's
    parts add up to it, which no median of them does)."""
    return statistics.fmean(s["step_s"] for r in summary["ranks"] for s in r["steps"])


def verify(
    cfg: Config,
    nproc: int,
    folder: Path,
    steps: int,
    n: int,
    hook: str | None = None,
    cause: str | None = None,
    force: bool = False,
) -> dict:
    """Profile `cfg`, then again with its N-th finding's remedy (or, given `cause`, the first
    finding of that cause); both measured in this one call (machines are noisy: times of
    different calls do not compare)."""
    from shardwise.profile.report import STATISTIC

    base = profile(cfg, nproc, folder, steps, hook, force)
    found = base["findings"]
    if cause is not None:
        n = next((i for i, f in enumerate(found, 1) if f["cause"] == cause), 0)
        if not n:
            causes = ", ".join(f["cause"] for f in found) or "none"
            raise ShardwiseError(f"the profile did not find {cause} (it found: {causes}).")
    if not 1 <= n <= len(found):
        raise ShardwiseError(
            f"--verify-remedy {n}: the profile has {len(found)} finding(s). Fix: "
            f"--verify-remedy 1..{len(found)}"
            if found
            else "the profile found no cause to remedy."
        )
    finding = found[n - 1]
    if not finding["remedy"]:
        raise ShardwiseError(
            f"finding {n} ({finding['cause']}) has no config remedy to run: "
            f"{finding['evidence']}. Fix: verify another finding."
        )
    other = with_overrides(cfg, finding["remedy"])
    after = profile(other, nproc, folder / f"remedy-{n}", steps, hook, force)
    before_s, after_s = step_s(base), step_s(after)
    result = {
        "finding": finding,
        "top": found[0]["cause"],
        "step_s_before": before_s,
        "step_s_after": after_s,
        "predicted_gain": finding["predicted_gain"],
        "measured_gain": 1.0 - after_s / before_s,
        "statistic": STATISTIC,  # of the step times, as the ledger and the findings
    }
    (folder / f"verify-{n}.json").write_text(json.dumps(result, indent=1))
    print(
        f"remedy {' '.join(finding['remedy'])}: {STATISTIC} step {before_s * 1e3:.1f} -> "
        f"{after_s * 1e3:.1f} ms; gain predicted {100 * result['predicted_gain']:.1f}%, "
        f"measured {100 * result['measured_gain']:.1f}%"
    )
    return result


def _count(flag: str, raw: str, example: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ShardwiseError(f"{flag} {raw} must be a whole number >= 1. Fix: {flag} {example}")
    return value


def _refuse_sized(overrides: list[str]) -> None:
    """`profile` sizes its run itself (profile.warmup + --steps + one traced step): a
    --profile.steps would be overwritten, so it is refused; a --train.steps (a train command
    profiled as it is) is replaced, and said so."""
    for o in overrides:
        key = o.removeprefix("--").split("=", 1)[0]
        if key == "profile.steps":
            raise ShardwiseError(
                f"{o} is set by `shardwise profile` itself: it runs profile.warmup steps, "
                "--steps K measured ones and one traced step. Fix: --steps K for the measured "
                "steps (--profile.warmup=W for the warm-up)."
            )
        if key == "train.steps":
            print(
                f"note: {o} is replaced: a profile runs profile.warmup steps, --steps K "
                "measured ones and one traced step (--steps K sets the measured ones)",
                file=sys.stderr,
            )


def profile_main(argv: list[str]) -> int:
    from shardwise.launchers.local import adopt_slurm_env, rank_main, under_external_launcher

    own, overrides = split_overrides(argv)
    args, rest = _parser().parse_known_args(own)
    if args.help:
        print(_parser().format_help())
        return 0
    try:
        if rest:
            raise ShardwiseError(f"unexpected argument(s) {' '.join(rest)}. Fix: see --help.")
        _refuse_sized(overrides)
        cfg = load_config(args.config, overrides)
        steps = _count("--steps", args.steps, 5)
        folder = Path(cfg.run.dir) / FOLDER
        if under_external_launcher():  # torchrun / srun started the ranks: one report, rank 0
            if args.verify_remedy is not None:
                raise ShardwiseError(
                    "--verify-remedy starts two runs itself. Fix: run it without torchrun/srun."
                )
            adopt_slurm_env()
            pcfg = profile_config(cfg, steps, folder)
            _writable(folder)  # (every rank: none starts when one could not write)
            rank_main(pcfg.to_dict())
            if os.environ["RANK"] == "0":
                summarise(pcfg, int(os.environ["WORLD_SIZE"]))
            return 0
        from shardwise.distributed.device import local_device_count

        nproc = local_device_count() if args.nproc is None else _count("--nproc", args.nproc, 2)
        if args.verify_remedy is not None:
            n = _count("--verify-remedy", args.verify_remedy, 1)
            verify(cfg, nproc, folder, steps, n, force=args.force)
        else:
            profile(cfg, nproc, folder, steps, force=args.force)
    except ShardwiseError as exc:
        return print_error(exc)
    return 0
