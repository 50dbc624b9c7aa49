"""`shardwise data prepare`: a corpus tokenised once into memory-mapped token shards.

The documents, their order, the held-out split, the BPE (trained on the same training
documents) and each document's ids with its end-of-text token are exactly those of the token
cache (data/tokens.py), so the train shards concatenated equal the cache's `train.bin`.
Shards are runs of whole documents, encoded by `workers` processes; each is written to a
temporary name, fsynced and renamed, then recorded in `manifest.partial.json` (the plan and
the shards done). A rerun of the same command keeps every recorded shard whose bytes still
match its checksum and encodes the rest; `manifest.json` is written last.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from shardwise.data.corpus import check_skipped, split_documents
from shardwise.data.identity import vocab_key
from shardwise.data.inputs import read_inputs
from shardwise.data.pretrained import (
    content_key,
    encode_documents,
    load_tokenizer,
    whole_documents,
)
from shardwise.data.resume import check_out, check_same, identity, kept
from shardwise.data.shards import KIND, MANIFEST, PARTIAL, VERSION
from shardwise.data.tokens import ENCODE_CHUNK_CHARS, EOS, _chunks, _train_bpe

# 64 MB of text per shard: ~16 M tokens, a 32 MB uint16 file; enough shards for every worker
# on a corpus of a few GB, few enough that the partial manifest stays small.
SHARD_MB = 64.0


@dataclass(frozen=True)
class Options:
    """What `shardwise data prepare` was asked (its command-line options)."""

    inputs: tuple[str, ...]
    out: str
    tokenizer: str = ""  # a Hugging Face tokenizer folder; "" = train the BPE as training does
    vocab_size: int = 4096  # of that BPE (training's model.vocab_size)
    text_field: str = "text"
    val_fraction: float = 0.02
    workers: int = 0  # processes; 0 = the CPU count (at most the shards to encode)
    shard_mb: float = SHARD_MB
    max_bad_rows: int = 100


@dataclass(frozen=True)
class Encoder:
    """A tokenizer as workers rebuild it: its JSON, whether it adds its own special tokens
    (a checkpoint's BOS), its end-of-text id and the shards' dtype."""

    json: str
    add_special: bool
    eos_id: int | None
    dtype: str

    def encode(self, tokenizer, texts: list[str]) -> np.ndarray:
        """The documents' ids, each followed by its end-of-text token, as one flat array: the
        token cache's rule (pretrained.encode_documents)."""
        docs = encode_documents(tokenizer, self.eos_id, texts, self.add_special)
        return np.fromiter(itertools.chain.from_iterable(docs), dtype=self.dtype)


# What every worker reads: set before the pool forks, so the documents are not pickled.
_JOB: dict = {}


def prepare(opts: Options, on_shard: Callable[[str], None] | None = None) -> dict:
    """Prepare `opts.inputs` into `opts.out` (resuming an unfinished run); return the
    manifest. `on_shard(name)` is called after each shard is recorded done."""
    start = time.perf_counter()
    out = Path(opts.out).expanduser().resolve()
    state = check_out(out)
    inputs = read_inputs(list(opts.inputs), opts.text_field, (str(out),))
    skipped = inputs.skipped
    check_skipped(len(skipped), skipped[:3], opts.text_field, opts.max_bad_rows, say=True)
    ident = identity(opts, inputs.identity)
    if state is not None:
        check_same(state, ident, out, opts)
        if state.pop("finished"):
            _say(f"{out} is already prepared from these inputs: nothing to do")
            return state
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp*"):  # ours only: the directory held nothing else at the start
        if stale.name.split(".tmp")[0] in (MANIFEST, PARTIAL, "tokenizer.json"):
            stale.unlink(missing_ok=True)
    if state is None:  # first, so that a rerun after a kill knows the directory is ours
        _write_json(out / PARTIAL, {"identity": ident, "plan": [], "done": {}})
    train, val = split_documents(inputs.docs, opts.val_fraction, " ".join(opts.inputs))
    del inputs
    encoder, tok_info = _tokenizer(opts, out, train, resuming=state is not None)
    plan = _plan({"train": train, "val": val}, opts.shard_mb)
    done = {} if state is None else kept(out, state.get("done", {}), plan)
    partial = {"identity": ident, "plan": plan, "tokenizer": tok_info, "done": done}
    _write_json(out / PARTIAL, partial)
    for p in plan:  # temporary files of ours a killed run left behind
        for stale in out.glob(f"{p['name']}.tmp*"):
            stale.unlink(missing_ok=True)
    if state is not None:
        _say(f"kept {len(done)} of {len(plan)} shards finished by an earlier run")
    todo = [p for p in plan if p["name"] not in done]
    _encode_all(todo, {"train": train, "val": val}, encoder, out, partial, opts, on_shard)
    manifest = _manifest(opts, ident, plan, done, tok_info, encoder.dtype, skipped)
    manifest["prepare_s"] = round(time.perf_counter() - start, 2)
    _write_json(out / MANIFEST, manifest)  # last: the marker of a finished prepare
    (out / PARTIAL).unlink(missing_ok=True)
    t, v = manifest["splits"]["train"]["tokens"], manifest["splits"]["val"]["tokens"]
    _say(f"prepared {t:,} train / {v:,} held-out tokens in {len(plan)} shards into {out}")
    return manifest


def _tokenizer(opts: Options, out: Path, train: list[str], resuming: bool) -> tuple[Encoder, dict]:
    """The encoder of the shards and the tokenizer's record; its JSON goes to tokenizer.json.
    A resumed BPE prepare reloads the BPE it trained (training again would take as long)."""
    from tokenizers import Tokenizer

    path = out / "tokenizer.json"
    if opts.tokenizer:
        tok = load_tokenizer(opts.tokenizer)
        text, vocab = whole_documents(tok).to_str(), len(tok)
        eos, bos, add_special = tok.eos_token_id, tok.bos_token_id, True
        info = {"kind": "hf", "source": opts.tokenizer, "content_key": content_key(opts.tokenizer)}
    else:
        if resuming and path.is_file():
            bpe = Tokenizer.from_file(str(path))
        else:
            n = sum(map(len, train))
            _say(f"training a {opts.vocab_size}-token BPE on {n / 1e6:.1f} M characters")
            bpe = _train_bpe(train, opts.vocab_size)
        text, vocab, add_special = bpe.to_str(), bpe.get_vocab_size(), False
        eos, bos = bpe.token_to_id(EOS), None
        info = {"kind": "bpe", "source": "bpe", "requested_vocab_size": opts.vocab_size}
    if not (resuming and path.is_file() and path.read_text() == text):
        _write_bytes(path, text.encode("utf-8"))
    dtype = "uint16" if vocab < 2**16 else "uint32"
    info.update(vocab_size=vocab, eos_id=eos, bos_id=bos, vocab_key=vocab_key(path))
    return Encoder(text, add_special, eos, dtype), info


def _plan(splits: dict[str, list[str]], shard_mb: float) -> list[dict]:
    """Consecutive runs of whole documents of each split, each about `shard_mb` MB of text."""
    budget = max(1, int(shard_mb * 1e6))
    plan = []
    for split, texts in splits.items():
        start, size, k = 0, 0, 0
        for i, text in enumerate(texts):
            size += len(text)
            if size >= budget or i == len(texts) - 1:
                name = f"{split}-{k:05d}.bin"
                plan.append({"name": name, "split": split, "start": start, "stop": i + 1})
                start, size, k = i + 1, 0, k + 1
    return plan


def _encode_all(todo, splits, encoder, out, partial, opts, on_shard) -> None:
    """Encode the shards of `todo` on worker processes, recording each as it finishes."""
    _JOB.update(splits=splits, encoder=encoder, out=out, tokenizer=None)
    workers = min(opts.workers or os.cpu_count() or 1, max(len(todo), 1))
    from tqdm import tqdm

    n = len(partial["plan"])
    bar = tqdm(total=n, initial=n - len(todo), desc="shardwise: shards", unit="shard")
    tokens, start = 0, time.perf_counter()
    tasks = [(p["name"], p["split"], p["start"], p["stop"]) for p in todo]
    pool = _fork_pool(workers) if workers > 1 and todo else None
    try:
        results = pool.imap_unordered(_encode_shard, tasks) if pool else map(_encode_shard, tasks)
        for name, count, digest in results:
            partial["done"][name] = {"tokens": count, "sha256": digest}
            _write_json(out / PARTIAL, partial)  # recorded only once the shard is in place
            tokens += count
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start) / 1e6:.2f} M tok/s")
            bar.update()
            if on_shard is not None:
                on_shard(name)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
        _JOB.clear()


def _fork_pool(workers: int):
    """Worker processes forked with SIGTERM's default action: terminate() ends them with it,
    and a worker that inherited a Python handler of the caller's (or stuck before running
    any Python) would ignore it, and terminate() would wait for it forever."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL) if main else None
    try:
        return mp.get_context("fork").Pool(workers, _quiet)
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)


def _quiet() -> None:
    # one encoding thread per worker process: the processes are the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # the parent's stop handlers are not the worker's: it ends when the pool ends it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_shard(task: tuple[str, str, int, int]) -> tuple[str, int, str]:
    """Encode one shard to a temporary file, fsync and rename it: (name, tokens, sha256)."""
    from tokenizers import Tokenizer

    name, split, start, stop = task
    enc: Encoder = _JOB["encoder"]
    if _JOB["tokenizer"] is None:
        _JOB["tokenizer"] = Tokenizer.from_str(enc.json)
    path = _JOB["out"] / name
    tmp = path.with_name(f"{name}.tmp{os.getpid()}")
    digest, total = hashlib.sha256(), 0
    with open(tmp, "wb") as f:
        for chunk in _chunks(_JOB["splits"][split][start:stop], ENCODE_CHUNK_CHARS):
            data = enc.encode(_JOB["tokenizer"], chunk).tobytes()
            digest.update(data)
            f.write(data)
            total += len(data) // np.dtype(enc.dtype).itemsize
        f.flush()
        os.fsync(f.fileno())  # on disk before it is recorded done
    os.replace(tmp, path)
    return name, total, digest.hexdigest()


def _manifest(opts, ident, plan, done, tok_info, dtype, skipped) -> dict:
    splits = {}
    for split in ("train", "val"):
        shards = [
            {"name": p["name"], "docs": p["stop"] - p["start"], **done[p["name"]]}
            for p in plan
            if p["split"] == split
        ]
        splits[split] = {
            "docs": sum(s["docs"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "shards": shards,
        }
    return {
        "kind": KIND,
        "version": VERSION,
        "inputs": list(opts.inputs),
        "text_field": opts.text_field,
        "val_fraction": opts.val_fraction,
        # which documents are held out: those whose id's stable hash is below val_fraction
        "held_out": "data/corpus.py split_documents: blake2b(document id) < val_fraction",
        "tokenizer": tok_info,
        "eos_id": tok_info["eos_id"],
        "dtype": dtype,
        "skipped_rows": [len(skipped), skipped[:3]],
        "splits": splits,
        "options": {k: v for k, v in asdict(opts).items() if k not in ("inputs", "out")},
        "identity": ident,
    }


def _write_json(path: Path, value: dict) -> None:
    _write_bytes(path, json.dumps(value, indent=1).encode("utf-8"))


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _say(message: str) -> None:
    print(f"shardwise: {message}", file=sys.stderr, flush=True)
