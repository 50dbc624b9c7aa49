"""`shardwise export RUN_DIR --format hf|peft|dcp OUT`: a run's newest checkpoint to another
format."""

from __future__ import annotations

import argparse
import sys

from shardwise.errors import ShardwiseError

_UNITS = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "b": 1}


def parse_size(text: str) -> int:
    t = text.strip().lower()
    for unit, factor in _UNITS.items():
        if t.endswith(unit) and t[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * factor)
    raise ShardwiseError(f"--max-shard-size {text!r} is not a size. Fix: e.g. --max-shard-size 2GB")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwise export",
        add_help=False,
        usage="%(prog)s RUN_DIR --format {hf,peft,dcp} OUT [--max-shard-size 2GB] [--step N] "
        "[--overwrite]",
        description="A run's newest checkpoint in another format.",
    )
    p.add_argument(
        "paths",
        nargs="*",
        metavar="RUN_DIR OUT",
        help="a run.dir (its newest checkpoint), a checkpoint.dir or one checkpoint directory; "
        "then the output directory",
    )
    p.add_argument(
        "--format",
        choices=["hf", "peft", "dcp"],
        help="hf: Hugging Face safetensors shards + index + config.json (a LoRA run's adapters "
        "merged in), loadable with transformers' from_pretrained(OUT); peft: a LoRA run's "
        "adapter alone, loadable with peft.PeftModel.from_pretrained(base, OUT); dcp: a "
        "PyTorch distributed checkpoint of the plain model's state dict (adapters merged in), "
        "loadable with torch.distributed.checkpoint.load",
    )
    p.add_argument(
        "--max-shard-size", default=None, help="--format hf: largest file written (default 2GB)"
    )
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help="export the checkpoint of this step (default: the newest)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT and everything in it when it is neither empty nor an earlier export "
        "(an earlier export is replaced whole without it)",
    )
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return p


def export_main(argv: list[str]) -> int:
    parser = _parser()
    args, rest = parser.parse_known_intermixed_args(argv)
    if args.help:
        print(parser.format_help())
        return 0
    try:
        if rest or len(args.paths) != 2 or args.format is None:
            raise ShardwiseError(
                f"expected RUN_DIR --format hf OUT, got {' '.join(argv) or 'nothing'}. "
                "Fix: shardwise export runs/default --format hf exported/"
            )
        run_dir, out = args.paths
        if args.max_shard_size is not None and args.format != "hf":
            raise ShardwiseError(
                f"--max-shard-size {args.max_shard_size} sizes the safetensors shards of "
                f"--format hf; --format {args.format} writes its own files. Fix: leave "
                "--max-shard-size out."
            )
        if args.format == "peft":
            from shardwise.checkpoint.export_peft import export_peft

            ckpt = export_peft(run_dir, out, step=args.step, overwrite=args.overwrite)
            what = "peft LoRA adapter"
        elif args.format == "dcp":
            from shardwise.checkpoint.export_dcp import export_dcp

            ckpt = export_dcp(run_dir, out, step=args.step, overwrite=args.overwrite)
            what = "PyTorch distributed checkpoint"
        else:
            from shardwise.checkpoint.export import export_hf

            size = parse_size(args.max_shard_size or "2GB")
            ckpt = export_hf(run_dir, out, size, step=args.step, overwrite=args.overwrite)
            what = "Hugging Face safetensors + config.json"
    except ShardwiseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return getattr(exc, "code", 2)  # 128 + the signal when one stopped it
    print(f"exported {ckpt} to {out} ({what})")
    return 0
