"""`shardwise export RUN_DIR --format hf|peft|dcp OUT`: a run's newest checkpoint to another
format; also a Hugging Face model directory to a DCP, and a model's DCP (its shape given as
`--model.*` keys) to Hugging Face safetensors (checkpoint/export_model.py)."""

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
        "[--overwrite]\n       %(prog)s HF_DIR --format dcp OUT\n"
        "       %(prog)s DCP_DIR --format hf OUT --model.name=NAME [--model.KEY=VALUE ...]",
        description="A run's newest checkpoint in another format; a Hugging Face Llama/GPT-2 "
        "directory as a PyTorch distributed checkpoint (DCP); a model's DCP (ours or "
        "torchtitan's) as Hugging Face safetensors, its shape from --model.* keys.",
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
    from shardwise.config import split_overrides

    parser = _parser()
    own, keys = split_overrides(argv)  # `--model.KEY[=| ]VALUE`: a model DCP's shape
    args, rest = parser.parse_known_intermixed_args(own)
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
        done = _export_model(args, run_dir, out, keys)
        if done is not None:
            ckpt, what = done
        elif keys:
            raise ShardwiseError(
                f"{keys[0]} gives the shape of a model's distributed checkpoint, which holds "
                f"no config; '{run_dir}' is a run or checkpoint whose config gives it. Fix: "
                "leave the --model.* keys out."
            )
        elif args.format == "peft":
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


def _export_model(
    args: argparse.Namespace, path: str, out: str, keys: list[str]
) -> tuple[str, str] | None:
    """Export a model directory that is not a run (checkpoint/export_model.py): (what was
    exported, in what format), or None for a run or checkpoint."""
    from shardwise.checkpoint import export_model as em

    kind = em.source_kind(path)
    if kind == "run":
        return None
    what = {"hf": "a Hugging Face model directory", "dcp": "a model's distributed checkpoint"}
    wanted = {"hf": "dcp", "dcp": "hf"}[kind]
    readers = {"hf": "from_pretrained and model.init_from", "dcp": "dcp.load and model.init_from"}
    if args.format != wanted:
        raise ShardwiseError(
            f"'{path}' is {what[kind]}: --format {args.format} would "
            + ("copy it as it is" if args.format == kind else "find no LoRA adapter in it")
            + f"; export writes it as --format {wanted}. Fix: --format {wanted}, or use it as "
            f"it is ({readers[kind]} read it)."
        )
    if args.step is not None:
        raise ShardwiseError(
            f"--step {args.step} picks a checkpoint of a run; '{path}' is {what[kind]}, one "
            "model. Fix: leave out --step."
        )
    if kind == "hf":
        if keys:
            raise ShardwiseError(
                f"{keys[0]}: '{path}' is {what[kind]}, its config.json gives the shape. Fix: "
                "leave the --model.* keys out."
            )
        init = em.export_hf_dir(path, out, overwrite=args.overwrite)
        print(f"model.init_from={out} reads it with: {' '.join(init)}")
        return path, "PyTorch distributed checkpoint"
    size = parse_size(args.max_shard_size or "2GB")
    em.export_model_dcp(path, out, keys, size, overwrite=args.overwrite)
    return path, "Hugging Face safetensors + config.json"
