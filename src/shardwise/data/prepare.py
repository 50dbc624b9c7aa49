"""`shardwise data prepare`: a corpus tokenised once into memory-mapped token shards.

The documents, their order, the held-out split, the BPE (trained on the same training
documents) and each document's ids with its end-of-text token are exactly those of the token
cache (data/tokens.py), so the train shards concatenated equal the cache's `train.bin`. The
corpus is never held whole: a scan plans the shards (data/scan.py), the documents stream past
again to be encoded in bounded chunks (data/encode.py). Shards are runs of whole documents;
each is written to a temporary name, fsynced and renamed, then recorded in
`manifest.partial.json` (the plan and the shards done). A rerun of the same command keeps
every recorded shard whose bytes still match its checksum and encodes the rest;
`manifest.json` is written last. One prepare at a time owns --out (dirlock.py), and it never
writes into a directory holding files it did not write. A refusal found only while reading
(an input undecodable or empty half-way, a document the tokenizer cannot encode) removes what
this prepare wrote: its shards, manifests, tokenizer.json and lock, and --out itself when it
created it and left it empty; files an earlier run wrote stay, and a kill or Ctrl-C removes
nothing (the rerun continues).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from shardwise.data.corpus import check_skipped
from shardwise.data.dirlock import LOCK, lock_dir
from shardwise.data.encode import Encoder, chunks, encode_all
from shardwise.data.identity import vocab_key
from shardwise.data.inputs import Input, documents, resolve_inputs
from shardwise.data.pretrained import content_key, has_tokenizer, load_tokenizer, whole_documents
from shardwise.data.resume import check_inputs, check_out, check_same, identity, kept, ours
from shardwise.data.scan import Rule, Scan, scan
from shardwise.data.shards import KIND, MANIFEST, PARTIAL, VERSION
from shardwise.data.tokens import BPE_TRAIN_CHARS, ENCODE_CHUNK_CHARS, EOS, _train_bpe
from shardwise.errors import DataError, ShardwiseError

# 64 MB of text per shard: ~16 M tokens, a 32 MB uint16 file; enough shards for every worker
# on a corpus of a few GB, few enough that the partial manifest stays small.
SHARD_MB = 64.0
# Characters of documents encoded as one task; at most 2 per worker are in flight, and one
# is filling per split, so the documents held at once are bounded by this, not the corpus.
CHUNK_CHARS = ENCODE_CHUNK_CHARS


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


def prepare(opts: Options, on_shard: Callable[[str], None] | None = None) -> dict:
    """Prepare `opts.inputs` into `opts.out` (resuming an unfinished run); return the
    manifest. `on_shard(name)` is called after each shard is recorded done."""
    start = time.perf_counter()
    out = Path(opts.out).expanduser().resolve()
    inputs = resolve_inputs(list(opts.inputs), opts.text_field, (str(out),))
    check_inputs(out, inputs)
    state = check_out(out)  # before anything is written: refuse someone else's directory
    ident = identity(opts, [f for one in inputs for f in one.identity])
    if state is not None:
        check_same(state, ident, out, opts)
        if state.pop("finished"):
            _say(f"{out} is already prepared from these inputs: nothing to do")
            return state
    hf = _load_hf(opts.tokenizer)  # a tokenizer that does not load: refused before writing
    busy = "two prepares would overwrite each other's shards"
    created, had_lock = not out.exists(), (out / LOCK).exists()
    lock = lock_dir(out, f"--out {str(out)!r}", "data prepare", busy, "--out", DataError)
    try:
        before = set(os.listdir(out))  # under the lock: what is here is no one's in flight
        return _prepare_locked(opts, out, inputs, ident, hf, on_shard, start)
    except ShardwiseError:  # refused half-way: nothing of this prepare is left to trip on
        _remove_written(out, before, created, had_lock)
        raise
    finally:
        lock.close()  # (the kernel drops the flock with the last descriptor)


def _remove_written(out: Path, before: set[str], created: bool, had_lock: bool) -> None:
    """Remove the files of ours in `out` that were not in `before` (this prepare wrote them),
    the lock file if this prepare made it, and `out` if it made it and it is now empty. An
    earlier run's files stay (a rerun keeps its shards) and no one else's is ever touched."""
    for name in sorted(set(os.listdir(out)) - before):
        if ours(name):
            (out / name).unlink(missing_ok=True)
    if not had_lock:  # (held until it is gone: dirlock.py's next owner locks a fresh one)
        (out / LOCK).unlink(missing_ok=True)
    if created:
        with contextlib.suppress(OSError):  # one file of anyone's there keeps it
            out.rmdir()


def _prepare_locked(opts, out, inputs, ident, hf, on_shard, start) -> dict:
    state = check_out(out)  # again, under the lock: another prepare may have run meanwhile
    if state is not None:
        check_same(state, ident, out, opts)
        if state.pop("finished"):
            _say(f"{out} is already prepared from these inputs: nothing to do")
            return state
    skipped: list[str] = []
    plan = _scan(opts, inputs, skipped)
    check_skipped(len(skipped), skipped[:3], opts.text_field, opts.max_bad_rows, say=True)
    for stale in out.glob("*.tmp*"):  # ours only: others' files were refused above
        if stale.name.split(".tmp")[0] in (MANIFEST, PARTIAL, "tokenizer.json"):
            stale.unlink(missing_ok=True)
    for p in plan.plan:  # temporary files of ours a killed run left behind
        for stale in out.glob(f"{p['name']}.tmp*"):
            stale.unlink(missing_ok=True)
    done = {} if state is None else kept(out, state.get("done", {}), plan.plan)
    partial = {"identity": ident, "plan": plan.plan, "done": done}
    _write_json(out / PARTIAL, partial)  # first, so that a rerun knows the directory is ours
    encoder, tok_info = _tokenizer(opts, out, hf, plan, resuming=state is not None)
    partial["tokenizer"] = tok_info
    _write_json(out / PARTIAL, partial)
    if state is not None:
        _say(f"kept {len(done)} of {len(plan.plan)} shards finished by an earlier run")
    _encode(opts, inputs, plan, encoder, out, partial, on_shard)
    manifest = _manifest(opts, ident, plan.plan, done, tok_info, encoder.dtype, skipped)
    manifest["prepare_s"] = round(time.perf_counter() - start, 2)
    _write_json(out / MANIFEST, manifest)  # last: the marker of a finished prepare
    (out / PARTIAL).unlink(missing_ok=True)
    t, v = manifest["splits"]["train"]["tokens"], manifest["splits"]["val"]["tokens"]
    _say(f"prepared {t:,} train / {v:,} held-out tokens in {len(plan.plan)} shards into {out}")
    return manifest


def _scan(opts: Options, inputs: list[Input], skipped: list[str]) -> Scan:
    """The shard plan (and the BPE's text) from one pass over the documents, or two when the
    held-out rule's corner cases show (data/scan.py)."""
    sample = 0 if opts.tokenizer else BPE_TRAIN_CHARS
    rule = Rule(opts.val_fraction)
    found = scan(documents(inputs, opts.text_field, skipped), rule, opts.shard_mb, sample)
    if found.rule != rule:
        skipped.clear()
        docs = documents(inputs, opts.text_field, skipped)
        found = scan(docs, found.rule, opts.shard_mb, sample)
    return found


def _load_hf(path: str):  # -> transformers.PreTrainedTokenizerFast | None
    """The --tokenizer folder's tokenizer (None: train a BPE); a missing one refused by name."""
    if not path:
        return None
    if not has_tokenizer(path):
        what = "does not exist" if not os.path.exists(path) else "holds no tokenizer"
        raise DataError(
            f"--tokenizer {path!r} {what} (no tokenizer.json or tokenizer_config.json). Fix: "
            "the folder tokenizer.save_pretrained wrote, or no --tokenizer to train a BPE."
        )
    return load_tokenizer(path)


def _tokenizer(opts: Options, out: Path, hf, plan: Scan, resuming: bool) -> tuple[Encoder, dict]:
    """The encoder of the shards and the tokenizer's record; its JSON goes to tokenizer.json.
    A resumed BPE prepare reloads the BPE it trained (training again would take as long)."""
    from tokenizers import Tokenizer

    path = out / "tokenizer.json"
    if hf is not None:
        text, vocab = whole_documents(hf).to_str(), len(hf)
        eos, bos, add_special = hf.eos_token_id, hf.bos_token_id, True
        info = {"kind": "hf", "source": opts.tokenizer, "content_key": content_key(opts.tokenizer)}
    else:
        if resuming and path.is_file():
            bpe = Tokenizer.from_file(str(path))
        else:
            n = plan.train_chars
            _say(f"training a {opts.vocab_size}-token BPE on {n / 1e6:.1f} M characters")
            bpe = _train_bpe(plan.sample, opts.vocab_size)  # (its first BPE_TRAIN_CHARS)
        plan.sample.clear()
        text, vocab, add_special = bpe.to_str(), bpe.get_vocab_size(), False
        eos, bos = bpe.token_to_id(EOS), None
        info = {"kind": "bpe", "source": "bpe", "requested_vocab_size": opts.vocab_size}
    if not (resuming and path.is_file() and path.read_text() == text):
        _write_bytes(path, text.encode("utf-8"))
    dtype = "uint16" if vocab < 2**16 else "uint32"
    info.update(vocab_size=vocab, eos_id=eos, bos_id=bos, vocab_key=vocab_key(path))
    return Encoder(text, add_special, eos, dtype), info


def _encode(opts, inputs, plan: Scan, encoder, out: Path, partial: dict, on_shard) -> None:
    """Stream the documents again into the shards not done, recording each as it finishes."""
    from tqdm import tqdm

    n, done = len(plan.plan), partial["done"]
    todo = n - len(done)
    workers = min(opts.workers or os.cpu_count() or 1, max(todo, 1))
    bar = tqdm(total=n, initial=n - todo, desc="shardwise: shards", unit="shard")
    tokens, t0 = 0, time.perf_counter()

    def record(name: str, count: int, digest: str) -> None:
        nonlocal tokens
        done[name] = {"tokens": count, "sha256": digest}
        _write_json(out / PARTIAL, partial)  # recorded only once the shard is in place
        tokens += count
        bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0) / 1e6:.2f} M tok/s")
        bar.update()
        if on_shard is not None:
            on_shard(name)

    stream = plan.rule.assign(documents(inputs, opts.text_field, []))
    work = chunks(stream, plan.plan, dict(done), CHUNK_CHARS)
    try:
        if todo:
            encode_all(work, encoder, out, workers, record)
    finally:
        bar.close()


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
