"""What an earlier `shardwise data prepare` left in --out, and whether a rerun may continue it.

A directory is the command's when it holds its manifest (finished) or its partial manifest
(unfinished, written before anything else); any other non-empty directory is refused, since
the command never deletes or overwrites files it did not write. A rerun continues (or, when
finished, reuses) a prepare only with the same tokenizer, input files (names, sizes, mtimes)
and options, and keeps a recorded shard only while its bytes match the recorded sha256.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from shardwise.data.pretrained import content_key
from shardwise.data.shards import KIND, MANIFEST, PARTIAL, VERSION
from shardwise.errors import DataError


def check_out(out: Path) -> dict | None:
    """The state of an earlier prepare in `out` (the manifest, or the partial one with
    "finished" false), None for a new or empty directory; refuse anything else's files."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is a file. Fix: --out naming a new directory.")
    for name, finished in ((MANIFEST, True), (PARTIAL, False)):
        if (out / name).is_file():
            try:
                state = json.loads((out / name).read_text())
            except (OSError, ValueError) as exc:
                raise DataError(
                    f"{str(out / name)!r} cannot be read ({exc}). Fix: another --out "
                    "directory (this one is left as it is)."
                ) from None
            if finished and state.get("kind") != KIND:
                break  # someone else's manifest.json
            return {**state, "finished": finished}
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries:
        raise DataError(
            f"--out {str(out)!r} already holds {len(entries)} entries that shardwise data prepare "
            f"did not write (e.g. {entries[0]!r}); it never deletes or overwrites them. Fix: "
            "--out naming a new or empty directory."
        )
    return None


def identity(opts, files: list) -> dict:  # opts: prepare.Options
    """Everything the shards depend on: a rerun must match it to continue or reuse them."""
    import tokenizers

    tok = (
        {"kind": "hf", "source": opts.tokenizer, "content_key": content_key(opts.tokenizer)}
        if opts.tokenizer
        else {"kind": "bpe", "vocab_size": opts.vocab_size, "tokenizers": tokenizers.__version__}
    )
    return {
        "version": VERSION,
        "tokenizer": tok,
        "files": [list(f) for f in files],
        "text_field": opts.text_field,
        "val_fraction": opts.val_fraction,
        "shard_mb": opts.shard_mb,
    }


def check_same(state: dict, ident: dict, out: Path, opts) -> None:
    """Refuse to continue (or reuse) the prepare in `out` with other inputs or options."""
    was = state["identity"]
    how = "finished" if state["finished"] else "unfinished"
    fix = "or --out naming another directory (this one is left as it is)."
    if was["tokenizer"] != ident["tokenizer"]:
        then, now = (_tok_flag(t) for t in (was["tokenizer"], ident["tokenizer"]))
        raise DataError(
            f"{now} differs from the {how} prepare in {str(out)!r}, which used {then}. Fix: "
            f"rerun with {then}, {fix}"
        )
    if was["files"] != ident["files"]:
        old = {f[0]: f[1:] for f in was["files"]}
        new = {f[0]: f[1:] for f in ident["files"]}
        what = (
            next((f"{p!r} is new" for p in new if p not in old), None)
            or next((f"{p!r} is gone" for p in old if p not in new), None)
            or next((f"{p!r} changed" for p in new if new[p] != old[p]), None)
            # the same files in another order: the documents' order and the held-out split
            # follow the order given
            or "the same files in another order"
        )
        raise DataError(
            f"the inputs {' '.join(opts.inputs)} differ from those of the {how} prepare in "
            f"{str(out)!r} ({what}). Fix: rerun on its inputs unchanged, {fix}"
        )
    for key, flag in (("text_field", "--text-field"), ("val_fraction", "--val-fraction")):
        if was[key] != ident[key]:
            raise DataError(
                f"{flag} {ident[key]} differs from the {how} prepare in {str(out)!r}, which "
                f"used {flag} {was[key]}. Fix: rerun with {flag} {was[key]}, {fix}"
            )
    if was["shard_mb"] != ident["shard_mb"]:
        raise DataError(
            f"--shard-mb {ident['shard_mb']} differs from the {how} prepare in {str(out)!r}, "
            f"which used --shard-mb {was['shard_mb']}. Fix: rerun with --shard-mb "
            f"{was['shard_mb']}, {fix}"
        )


def _tok_flag(tok: dict) -> str:
    if tok["kind"] == "hf":
        return f"--tokenizer {tok['source']} (content key {tok['content_key']})"
    return f"the trained BPE of --vocab-size {tok['vocab_size']}"


def kept(out: Path, done: dict, plan: list[dict]) -> dict:
    """The recorded shards of the plan whose file still holds the recorded bytes."""
    names = {p["name"] for p in plan}
    return {n: r for n, r in done.items() if n in names and _sha256(out / n) == r["sha256"]}


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()
