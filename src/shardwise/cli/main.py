"""`shardwise train | explain`: argument parsing and user-facing error reporting."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from shardwise.config import Config, load_config, reference_markdown, split_overrides
from shardwise.errors import ShardwiseError, print_error
from shardwise.launchers.process_exit import skip_exit_collection
from shardwise.training.preempt import Preempted


def parser(command: str = "train") -> argparse.ArgumentParser:
    """The options of `train` and `explain` (one parser: explain refuses train's own)."""
    p = argparse.ArgumentParser(
        prog=f"shardwise {command}",
        add_help=False,
        usage="%(prog)s [CONFIG.toml] [--section.key=value ...] [options]",
        description=COMMANDS[command],
    )
    p.add_argument("config", nargs="?", default=None, help="TOML config; keys as --help-config")
    p.add_argument(
        "--nproc",
        "--nproc-per-node",
        dest="nproc",
        default=None,
        metavar="N",
        help="local ranks to spawn (per node with --nnodes; default: one per device)",
    )
    p.add_argument("--nnodes", default=None, metavar="N", help="machines the job spans")
    p.add_argument("--node-rank", default=None, metavar="R", help="this machine's index")
    p.add_argument("--rdzv", default=None, metavar="HOST:PORT", help="rendezvous of all nodes")
    p.add_argument(
        "--max-restarts",
        default="0",
        metavar="K",
        help="train: restart every rank after a failure, up to K times",
    )
    p.add_argument("--json", action="store_true", help="explain: machine-readable output")
    p.add_argument(
        "--hardware",
        default=None,
        metavar="NAME",
        help="explain: predict for this catalog hardware (default: this machine's); "
        "--hardware.FIELD=VALUE overrides one field of its entry (e.g. inter_bw=6.25e9)",
    )
    p.add_argument(
        "--help-config", action="store_true", help="every config key, its default and meaning"
    )
    p.add_argument(
        "--plan",
        choices=["auto"],
        default=None,
        help="train: pick the best layout for this hardware and world size first",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="start even if the plan predicts more memory than this machine has",
    )
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return p


def _split(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, overrides = split_overrides(argv)
    known, rest = parser().parse_known_args(own)
    if known.config is not None and known.config.startswith("-"):
        rest.insert(0, known.config)
        known.config = None
    return known, rest + overrides


COMMANDS = {
    "train": "Train a model: spawns --nproc local ranks unless under torchrun/srun. The "
    "model is a preset (--model.name=tiny), a Hugging Face checkpoint with its own tokenizer "
    "(--model.init_from=DIR: Llama/GPT-2 into our decoders, any other with --model.name=hf), "
    "or your own nn.Module (--model.name=module:factory or file.py:factory); from Python, "
    "shardwise.train(config, model=..., dataset=..., loss=...).",
    "explain": "Every derived value of a config and the planner's per-rank prediction of "
    "memory by category and step time.",
}
USAGE = """usage: shardwise {train,explain,profile,plan,launch,export,data} [CONFIG.toml]
                 [--nproc N] [--section.key=value ...]

  train     train a model (spawns --nproc local ranks unless under torchrun/srun);
            on several machines: --nnodes N --node-rank R --rdzv HOST:PORT, --nproc per node;
            --plan auto first picks the best layout for this hardware and world size;
            --max-restarts K restarts every rank after a failure, from the newest valid
            checkpoint (checkpoint.resume=auto)
  explain   print every derived value of a config and the planner's per-rank prediction of
            memory by category and step time (--json for machine-readable output)
  profile   run a few steps on every rank and say where each step's time went (a ledger per
            rank, traces, a merged timeline) and what to change, with the predicted gain:
            --steps K, --verify-remedy N (`shardwise profile -h`)
  plan      predict memory and step time of every layout on some hardware and rank them
            (`shardwise plan -h` for its options)
  launch    write (and submit) a job for a cluster: `shardwise launch {slurm,k8s} --help`
  export    RUN_DIR --format hf|peft|dcp OUT: the newest checkpoint as Hugging Face
            safetensors, a peft adapter or a PyTorch distributed checkpoint
  data      prepare INPUT... --out DIR: tokenise a corpus once into memory-mapped shards
            (resumable), to train on with --data.dataset=DIR (`shardwise data prepare -h`)

  --help-config   list every config key with its default and meaning
"""


def _whole(flag: str, raw: str, least: int, example: int) -> int:
    """`raw` (the value given to `flag`) as an int >= `least`, or one message with the fix."""
    try:
        value = int(raw)
    except ValueError:
        raise ShardwiseError(
            f"{flag} {raw!r} is not a whole number. Fix: {flag} {example}"
        ) from None
    if value < least:
        raise ShardwiseError(f"{flag}={value} must be >= {least}. Fix: {flag} {example}")
    return value


def _nproc(args: argparse.Namespace) -> int:
    from shardwise.distributed.device import local_device_count

    if args.nproc is None:
        return local_device_count()
    return _whole("--nproc", args.nproc, 1, 2)


def cmd_train(cfg: Config, args: argparse.Namespace) -> None:
    if args.hardware or args.hardware_overrides:
        raise ShardwiseError(
            "--hardware predicts for other hardware in `shardwise explain` and `plan`; train "
            "runs on the hardware it finds. Fix: drop --hardware here."
        )
    if cfg.profile.steps:
        raise ShardwiseError(
            f"profile.steps={cfg.profile.steps} is set by `shardwise profile --steps K`, which "
            "also sizes the run and writes the report. Fix: shardwise profile --steps "
            f"{cfg.profile.steps} [the same options] (train keeps a ledger per step anyway)."
        )
    from shardwise.launchers.local import (
        adopt_slurm_env,
        launch_local,
        rank_main,
        under_external_launcher,
    )

    if args.nnodes is not None:  # one elastic agent per node, even inside a Slurm step
        from shardwise.cli.launch import train_nodes

        train_nodes(cfg, _nproc(args), args)
        return
    from shardwise.job import check_restarts, prepare

    max_restarts = check_restarts(args.max_restarts, cfg, under_external_launcher())
    if under_external_launcher():
        adopt_slurm_env()
        if os.environ.get("RANK") == "0":  # the plan line, once, as a local run prints it
            from shardwise.job.explain import explain_record, print_plan

            # (an error: every rank reports it below, not rank 0 alone before the others)
            with contextlib.suppress(ShardwiseError):
                print_plan(explain_record(cfg, int(os.environ["WORLD_SIZE"])))
        rank_main(cfg.to_dict())
        return
    nproc = _nproc(args)
    with prepare(cfg, nproc, force=args.force, plan_auto=args.plan == "auto") as job:
        launch_local(job.cfg, nproc, max_restarts=max_restarts, derived=job.derived)


def cmd_explain(cfg: Config, args: argparse.Namespace) -> None:
    from shardwise.cli.launch import explain_world
    from shardwise.job.explain import explain_record, print_explain

    if args.max_restarts not in (None, "0"):
        raise ShardwiseError("--max-restarts is an option of train. Fix: drop it here.")
    from shardwise.plan.hardware import detect_hardware, get_hardware, with_overrides

    hw = get_hardware(args.hardware) if args.hardware else detect_hardware()
    hw = with_overrides(hw, args.hardware_overrides)
    record = explain_record(cfg, explain_world(args, _nproc(args)), hw)
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print_explain(record)


def main(argv: list[str] | None = None) -> int:
    skip_exit_collection()  # the process ends with the command: seconds under load otherwise
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--help-config"):
        if not argv:  # no arguments at all: the default job
            argv = ["train"]
        else:
            print(reference_markdown() if argv[0] == "--help-config" else USAGE)
            return 0
    command, rest = argv[0], argv[1:]
    if command == "export":
        from shardwise.cli.export import export_main

        return export_main(rest)
    if command == "profile":
        from shardwise.cli.profile import profile_main

        return profile_main(rest)
    if command == "launch":
        from shardwise.cli.launch import launch_main

        return launch_main(rest)
    if command == "data":
        from shardwise.cli.data import data_main

        return data_main(rest)
    commands = {"train": cmd_train, "explain": cmd_explain, "plan": None}
    try:
        if command == "plan":
            from shardwise.cli.plan import run

            return run(*split_overrides(rest))
        if command not in commands:
            raise ShardwiseError(f"unknown command '{command}'. Fix: one of {', '.join(commands)}.")
        from shardwise.plan.hardware import take_hardware_overrides

        args, overrides = _split(rest)
        args.hardware_overrides, overrides = take_hardware_overrides(overrides)
        if args.help:
            print(parser(command).format_help())
            return 0
        if args.help_config:
            print(reference_markdown())
            return 0
        cfg = load_config(args.config, overrides)
        commands[command](cfg, args)
    except Preempted as exc:  # told to stop, and saved: 128 + the signal
        print(f"shardwise: {exc}", file=sys.stderr)
        return exc.code
    except ShardwiseError as exc:
        return print_error(exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
