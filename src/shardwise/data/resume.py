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
import os
import re
from pathlib import Path

from shardwise.data.dirlock import LOCK
from shardwise.data.inputs import stream_spec
from shardwise.data.pretrained import content_key
from shardwise.data.shards import KIND, MANIFEST, PARTIAL, VERSION
from shardwise.errors import DataError


def check_out(out: Path) -> dict | None:
    """The state of an earlier prepare in `out` (the manifest, or the partial one with
    "finished" false), None for a new or empty directory; refuse anything else's files."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is a file. Fix: --out naming a new directory.")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    entries = [e for e in entries if not _LEFT.match(e)]
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
            if not finished:  # a rerun writes there: only beside files of ours
                _refuse_foreign(out, [e for e in entries if not _OURS.match(e)], "beside")
            return {**state, "finished": finished}
    _refuse_foreign(out, entries, "")
    return None


# What a prepare writes in --out (the shards, manifests, tokenizer and their temporary
# names), and what its lock leaves (dirlock.py): nothing else is ever touched.
_OURS = re.compile(
    r"^((train|val)-\d{5}\.bin|manifest\.json|manifest\.partial\.json|tokenizer\.json)"
    r"(\.tmp\d+)?$"
)
_LEFT = re.compile(rf"^({re.escape(LOCK)}|\.shardwise-writable-.*)$")


def ours(name: str) -> bool:
    """Whether an entry of --out named `name` is one a prepare writes (a shard, a manifest,
    tokenizer.json or a temporary name of one): the only names it ever removes."""
    return bool(_OURS.match(name))


def _refuse_foreign(out: Path, foreign: list[str], beside: str) -> None:
    if not foreign:
        return
    shown = ", ".join(repr(e) for e in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    where = " beside an unfinished prepare's files" if beside else ""
    raise DataError(
        f"--out {str(out)!r} already holds {len(foreign)} "
        f"entr{'y' if len(foreign) == 1 else 'ies'} that shardwise data prepare did not "
        f"write{where} ({shown}); it never deletes or overwrites them. Fix: --out naming a new "
        "or empty directory."
    )


def check_inputs(out: Path, inputs: list) -> None:  # inputs: inputs.Input
    """Refuse an --out that is, holds or lies inside one of the inputs: the prepare would
    read its own files as documents and write among the user's, and its shards, manifest and
    tokenizer.json would become documents of that input for every later reader."""
    fix = "Fix: --out naming a new directory outside the inputs."
    for one in inputs:
        paths = [Path(f[0]) for f in one.identity if os.path.isabs(f[0])]
        held = [p for p in paths if p == out or out in p.parents]
        if held:
            raise DataError(
                f"--out {str(out)!r} holds INPUT {one.raw!r} (e.g. '{held[0]}'): the prepare "
                f"would read its own output as documents and write among your files. {fix}"
            )
        root = _root(one)
        if root is not None and (out == root or root in out.parents):
            raise DataError(
                f"--out {str(out)!r} lies inside INPUT {one.raw!r}: its shards, manifest and "
                "tokenizer.json would become documents of that input for every later reader "
                f"(training on it, another prepare). {fix}"
            )


def _root(one) -> Path | None:
    """The directory an input reads everything below (None: it names its files)."""
    if one.saved is not None:
        return one.saved.resolve()
    pattern = stream_spec(one.raw).get("data_files", "") if one.stream is not None else one.raw
    if one.source is not None and one.source.is_stdlib:
        return Path(os.path.commonpath([str(f) for f in one.source.files]))
    path = Path(os.path.expanduser(pattern))
    if one.source is not None and path.is_dir():
        return path.resolve()
    if "**" in pattern:  # a recursive glob reaches every folder below its fixed part
        return Path(os.path.realpath(os.path.dirname(re.split(r"[*?\[]", pattern)[0]) or "."))
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
