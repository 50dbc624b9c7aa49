"""What a checkpoint records of the data it was trained on, and what a resume may change.

A model's embedding rows mean the tokens of the tokenizer it was trained with: a BPE trained
on other (or grown) data gives thousands of ids another meaning, and a classifier's outputs
mean its labels in their order. So a checkpoint stores the data's identity (the dataset, its
files' names and sizes, a hash of the tokenizer's vocabulary, the labels) and a resume
refuses another tokenizer or other labels; other data with the same tokenizer is a
legitimate continuation (fine-tuning on more data) and is only reported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import weakref

from shardwise.data.classify import ClassifyDataset
from shardwise.data.corpus import DataSpec, resolve_source
from shardwise.data.pretrained import content_key
from shardwise.data.tokens import TokenDataset

# data set object -> its identity: computed once per run (files are stat'ed, the vocabulary
# read), at the first save
_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _digest(value) -> str:
    blob = json.dumps(value, sort_keys=True).encode("utf-8")
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def vocab_key(tokenizer_json) -> str:
    """A hash of the id -> token table of a `tokenizers` file: equal exactly when every id
    means the same token (merges or normalisation settings may differ)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab(with_added_tokens=True)
    return _digest(sorted(vocab.items(), key=lambda kv: kv[1]))


def data_identity(spec: DataSpec, train_data) -> dict:
    """The identity of the data a run trains on (`train_data`: its loaded training split)."""
    try:
        return _KNOWN[train_data]
    except (KeyError, TypeError):  # TypeError: an object that takes no weak reference
        pass
    ident: dict = {"dataset": spec.dataset} if not spec.blend else {"dataset": spec.blend}
    # a save must not fail because a data file went away meanwhile: what cannot be read is
    # left out of the identity, and left unchecked on resume
    with contextlib.suppress(Exception):
        ident.update(_files(spec))
    with contextlib.suppress(Exception):
        if isinstance(train_data, TokenDataset):
            what = f"the tokenizer of {spec.tokenizer}" if spec.tokenizer else "a BPE trained on it"
            ident["tokenizer"] = {"what": what, "key": vocab_key(train_data.tokenizer_path)}
        elif spec.tokenizer:
            what = f"the tokenizer of {spec.tokenizer}"
            ident["tokenizer"] = {"what": what, "key": content_key(spec.tokenizer)}
    if isinstance(train_data, ClassifyDataset):
        ident["labels"] = list(train_data.label_names)
    with contextlib.suppress(TypeError):
        _KNOWN[train_data] = ident
    return ident


def _files(spec: DataSpec) -> dict:
    """How many files, how many bytes, and a hash of their names and sizes (not mtimes: a
    copy of the same data is the same data)."""
    if spec.dataset == "digits" or spec.is_user or spec.blend:
        return {}
    from shardwise.data.shards import is_prepared, read_manifest

    if is_prepared(spec.dataset):  # its shards and their checksums are the data
        m = read_manifest(spec.dataset)
        shards = [s for split in ("train", "val") for s in m["splits"][split]["shards"]]
        itemsize = 4 if m["dtype"] == "uint32" else 2
        return {
            "files": len(shards),
            "bytes": sum(s["tokens"] * itemsize for s in shards),
            "content": _digest([s["sha256"] for s in shards]),
        }
    source = resolve_source(spec)
    sizes = [(rel, p.stat().st_size) for rel, p in zip(source.ids, source.files, strict=True)]
    return {
        "files": len(sizes),
        "bytes": sum(size for _, size in sizes),
        "content": _digest(sizes),
    }


def _describe(ident: dict) -> str:
    if "files" not in ident:
        return f"data.dataset={ident['dataset']!r}"
    n = ident["files"]
    return f"data.dataset={ident['dataset']!r} ({n} file{'s' * (n != 1)}, {ident['bytes']:,} bytes)"


def compare_data(
    saved: dict | None, now: dict, path, new_run: str = "--run.dir=<another directory>"
) -> tuple[str | None, str | None]:
    """(refusal, note) for resuming the checkpoint at `path`, trained on `saved` data, on the
    data `now`: another tokenizer or other labels are refused; other data is noted.
    `new_run`: the flag that starts a new run elsewhere (checkpoint/lineage.new_run)."""
    if not saved:  # saved before checkpoints recorded their data
        return None, None
    fix = (
        f"Fix: resume on the data it was trained on, unchanged ({_describe(saved)}), or start "
        f"a new run on this data with {new_run}."
    )
    was, tok = saved.get("tokenizer"), now.get("tokenizer")
    if was and tok and was["key"] != tok["key"]:
        return (
            f"checkpoint {path} was trained on {_describe(saved)} with {was['what']}; this run "
            f"has {_describe(now)} and {tok['what']}, whose vocabulary differs: the saved "
            f"weights would read other tokens behind the same ids. {fix}"
        ), None
    if saved.get("labels") is not None and saved.get("labels") != now.get("labels"):
        return (
            f"checkpoint {path} was trained on {_describe(saved)} with the labels "
            f"{saved['labels'][:10]}; this run's {_describe(now)} has the labels "
            f"{now.get('labels', [])[:10]}: the classifier's outputs would change meaning. {fix}"
        ), None
    keys = ("dataset", "files", "bytes", "content")
    if any(saved.get(k) != now.get(k) for k in keys):
        return None, (
            f"the data changed since that checkpoint (saved: {_describe(saved)}; now: "
            f"{_describe(now)}); the tokenizer is the same, so training continues on the new "
            "data from the saved sample position"
        )
    return None, None
