"""`shardwise data prepare`: tokenise a corpus once into memory-mapped shards."""

from __future__ import annotations

import argparse
import sys

from shardwise.errors import ShardwiseError, print_error

DESCRIPTION = (
    "Tokenise INPUT... (files, globs, directories of .txt/.jsonl/.json/.csv/.parquet, "
    "stdlib, folders a `datasets` object was saved to, or hf:NAME[:OPTION=VALUE,...]: a "
    "`datasets` dataset read in streaming mode, e.g. 'hf:json:data_files=dir/*.jsonl') "
    "into memory-mapped token shards "
    "and a manifest in --out, on --workers processes, reading the corpus as a stream (never "
    "whole in memory). A rerun after a kill keeps the shards already done; one prepare at a "
    "time owns --out. Train on it with --data.dataset=DIR (the same samples and losses as "
    "training on the raw corpus with the same tokenizer and held-out fraction)."
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise data", description=DESCRIPTION)
    verbs = p.add_subparsers(dest="verb", required=True, metavar="prepare")
    v = verbs.add_parser("prepare", description=DESCRIPTION, help="tokenise a corpus to shards")
    v.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="file, glob, directory, stdlib, saved dataset, hf:NAME[:data_files=GLOB,split=S,...]",
    )
    v.add_argument("--out", required=True, metavar="DIR", help="new or empty directory")
    v.add_argument(
        "--tokenizer",
        default="",
        metavar="DIR",
        help="a Hugging Face tokenizer folder (default: train shardwise's byte-level BPE on "
        "the training documents, as `shardwise train` does)",
    )
    v.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="the trained BPE's size: the model.vocab_size you will train with (default 4096; "
        "not with --tokenizer, whose vocabulary is its own)",
    )
    v.add_argument("--text-field", default="text", help="column holding the text (default text)")
    v.add_argument(
        "--val-fraction",
        type=float,
        default=0.02,
        metavar="F",
        help="held-out fraction of documents, as data.val_fraction (default 0.02)",
    )
    v.add_argument(
        "--workers", type=int, default=0, metavar="N", help="processes (default: CPU count)"
    )
    v.add_argument(
        "--shard-mb", type=float, default=64.0, metavar="MB", help="text per shard (default 64)"
    )
    v.add_argument(
        "--max-bad-rows",
        type=int,
        default=100,
        metavar="N",
        help="rows without a text value skipped before refusing, as data.max_bad_rows",
    )
    return p


def _check(args: argparse.Namespace) -> None:
    if args.tokenizer and args.vocab_size is not None:
        raise ShardwiseError(
            f"--vocab-size {args.vocab_size} sizes the BPE trained on the documents, and "
            f"--tokenizer {args.tokenizer} brings a vocabulary of its own. Fix: drop "
            "--vocab-size (or --tokenizer, to train a BPE of that size)."
        )
    if args.vocab_size is None:
        args.vocab_size = 4096
    for flag, value, least, example in (
        ("--vocab-size", args.vocab_size, 257, 4096),  # 256 bytes + <|endoftext|>
        ("--workers", args.workers, 0, 2),
        ("--max-bad-rows", args.max_bad_rows, 0, 100),
    ):
        if value < least:
            raise ShardwiseError(f"{flag} {value} must be >= {least}. Fix: {flag} {example}.")
    if not 0.0 <= args.val_fraction < 1.0:
        raise ShardwiseError(
            f"--val-fraction {args.val_fraction} must be in [0, 1). Fix: --val-fraction 0.02."
        )
    if not args.shard_mb > 0:
        raise ShardwiseError(f"--shard-mb {args.shard_mb} must be > 0. Fix: --shard-mb 64.")


def data_main(argv: list[str]) -> int:
    """`shardwise data VERB ...`; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        _check(args)
        from shardwise.data.prepare import Options, prepare

        prepare(
            Options(
                inputs=tuple(args.inputs),
                out=args.out,
                tokenizer=args.tokenizer,
                vocab_size=args.vocab_size,
                text_field=args.text_field,
                val_fraction=args.val_fraction,
                workers=args.workers,
                shard_mb=args.shard_mb,
                max_bad_rows=args.max_bad_rows,
            )
        )
    except ShardwiseError as exc:
        return print_error(exc)
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to finish", file=sys.stderr)
        return 130
    return 0
