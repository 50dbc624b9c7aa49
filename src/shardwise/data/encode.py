"""The encoding pass of `shardwise data prepare`: documents streamed into token shards.

The documents are read again in order and split by the scan's rule (data/scan.py); each run
of a shard's documents is cut into chunks of about `chunk_chars` characters, encoded on
worker processes and handed back in order, so the main process appends each chunk's ids to
its shard's temporary file. At most two chunks per worker are in flight and one fills per
split: the documents held at once are bounded by the chunk size and the worker count, never
by the corpus. A shard whose last chunk is written is fsynced, renamed to its name and then
recorded done; shards an earlier run finished are read past, not encoded.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing as mp
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwise.data.dirlock import forget_inherited
from shardwise.data.pretrained import encode_documents
from shardwise.errors import DataError


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


# What every worker reads: set before the pool forks (the encoder is not pickled per task).
_JOB: dict = {}


def chunks(
    stream: Iterable[tuple[str, str]], plan: list[dict], done: dict, chunk_chars: int
) -> Iterator[tuple[str, list[str], bool]]:
    """(shard name, texts, last chunk of the shard) for the shards of `plan` not in `done`,
    from `stream`'s (split, text) pairs in order; refuse a stream that no longer matches the
    plan (an input changed since the scan)."""
    runs = {split: [p for p in plan if p["split"] == split] for split in ("train", "val")}
    k, i = {"train": 0, "val": 0}, {"train": 0, "val": 0}
    texts: dict[str, list[str]] = {"train": [], "val": []}
    size = {"train": 0, "val": 0}
    for split, text in stream:
        if k[split] >= len(runs[split]):
            _changed(split, "more")
        shard = runs[split][k[split]]
        i[split] += 1
        last = i[split] == shard["stop"]
        if shard["name"] not in done:  # a finished shard's documents are read past
            texts[split].append(text)
            size[split] += len(text)
            if last or size[split] >= chunk_chars:
                yield shard["name"], texts[split], last
                texts[split], size[split] = [], 0
        k[split] += last
    for split, run in runs.items():
        if k[split] != len(run):
            _changed(split, "fewer")


def _changed(split: str, what: str) -> None:
    raise DataError(
        f"the inputs gave {what} {split} documents than when this prepare planned its shards: "
        "a file changed while it ran. Fix: rerun the same command once the inputs stay put."
    )


def encode_all(
    work: Iterable[tuple[str, list[str], bool]],
    encoder: Encoder,
    out: Path,
    workers: int,
    on_done: Callable[[str, int, str], None],
) -> None:
    """Encode `work`'s chunks on `workers` processes (1: in this one), append each to its
    shard's temporary file in order, and rename each finished shard into place, then call
    `on_done(name, tokens, sha256)`."""
    _JOB.update(encoder=encoder, tokenizer=None)
    pool = _fork_pool(workers) if workers > 1 else None
    writing: dict[str, _Shard] = {}
    pending: deque = deque()
    try:
        for name, texts, last in work:
            job = pool.apply_async(_encode, (texts,)) if pool else _Ready(_encode(texts))
            pending.append((name, last, job))
            del texts  # the pool holds its pickled copy until a worker takes it
            while len(pending) >= 2 * workers:  # bounded: a slow writer stops the reader
                _write(*pending.popleft(), writing, out, encoder.dtype, on_done)
        while pending:
            _write(*pending.popleft(), writing, out, encoder.dtype, on_done)
    finally:
        for shard in writing.values():  # unfinished: the temporary file is the next run's
            shard.file.close()
        if pool is not None:
            pool.terminate()
        _JOB.clear()


class _Ready:
    """The result of a chunk encoded in this process, as the pool's results are read."""

    def __init__(self, value: bytes) -> None:
        self.value = value

    def get(self) -> bytes:
        return self.value


@dataclass
class _Shard:
    tmp: Path
    file: object
    digest: object
    tokens: int = 0


def _write(name, last, job, writing: dict, out: Path, dtype: str, on_done) -> None:
    data = job.get()
    shard = writing.get(name)
    if shard is None:
        tmp = out / f"{name}.tmp{os.getpid()}"
        shard = writing[name] = _Shard(tmp, open(tmp, "wb"), hashlib.sha256())  # noqa: SIM115
    shard.file.write(data)
    shard.digest.update(data)
    shard.tokens += len(data) // np.dtype(dtype).itemsize
    if last:
        shard.file.flush()
        os.fsync(shard.file.fileno())  # on disk before it is recorded done
        shard.file.close()
        del writing[name]
        os.replace(shard.tmp, out / name)
        on_done(name, shard.tokens, shard.digest.hexdigest())


def _encode(texts: list[str]) -> bytes:
    """One chunk's ids as bytes, with the tokenizer this process built from the job's JSON."""
    from tokenizers import Tokenizer

    enc: Encoder = _JOB["encoder"]
    if _JOB["tokenizer"] is None:
        _JOB["tokenizer"] = Tokenizer.from_str(enc.json)
    try:
        return enc.encode(_JOB["tokenizer"], texts).tobytes()
    except Exception as exc:  # tokenizers raises TypeError, its own... by document
        raise _unencodable(enc, texts, exc) from None


def _unencodable(enc: Encoder, texts: list[str], exc: Exception) -> DataError:
    """The refusal of a chunk the tokenizer fails on, naming the first document it fails on
    (found by encoding them one at a time: only ever on this failing path)."""
    bad = next((t for t in texts if not _encodes(enc, t)), texts[0] if texts else "")
    why = (str(exc).strip().splitlines() or [""])[0][:200]
    return DataError(
        f"the tokenizer cannot encode the document that begins {bad[:60]!r} "
        f"({type(exc).__name__}: {why}). Fix: repair or drop that document (e.g. a lone "
        "surrogate from a JSON \\u escape is not text), or --tokenizer one that encodes it."
    )


def _encodes(enc: Encoder, text: str) -> bool:
    try:
        enc.encode(_JOB["tokenizer"], [text])
    except Exception:
        return False
    return True


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
    # the parent's --out lock ends with the parent, never held on by a worker (dirlock.py)
    forget_inherited()
    # one encoding thread per worker process: the processes are the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # the parent's stop handlers are not the worker's: it ends when the pool ends it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
