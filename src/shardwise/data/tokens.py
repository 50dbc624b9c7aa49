"""Tokenised text corpora: a locally trained byte-level BPE and memory-mapped token arrays.

The cache directory for a corpus is named by a stable hash of everything its contents depend
on (file names, sizes and mtimes, vocab size, held-out fraction, text field, format version),
so any process, run or rank that asks for the same data finds the same files. Builds take a
file lock and write every file to a temporary name before `os.replace`, with `meta.json`
written last as the "complete" marker: concurrent callers build once and never read halves.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardwise.data.cache import read_meta
from shardwise.data.corpus import (
    DataSpec,
    Source,
    check_skipped,
    read_documents,
    resolve_source,
    split_documents,
)
from shardwise.data.pretrained import (
    check_vocab,
    content_key,
    encode_documents,
    load_tokenizer,
    whole_documents,
)
from shardwise.errors import DataError

FORMAT_VERSION = 1
EOS = "<|endoftext|>"
# BPE training time grows with the text it sees; 32 M characters (all of the stdlib's ~31 MB)
# train in ~5 s on 2 cores, and merges learned from more text barely change. Larger user
# corpora train on their first 32 M characters of training documents (all are encoded).
BPE_TRAIN_CHARS = 32_000_000
# Characters handed to one `encode_batch_fast` call: big enough to keep every core busy,
# small enough that the ids of one chunk stay a few hundred MB at most.
ENCODE_CHUNK_CHARS = 8_000_000


def sample_indices(indices: torch.Tensor, n: int) -> np.ndarray:
    """A batch's sample indices as an int64 array; IndexError for any outside [0, n)."""
    idx = torch.as_tensor(indices, dtype=torch.int64).cpu().numpy()
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"sample index out of range [0, {n}): {idx.tolist()}")
    return idx


class TokenDataset:
    """Packed next-token samples over one memory-mapped token array.

    Sample i is the window tokens[i*S : i*S + S + 1] (S = seq_len): windows overlap by one
    token so that every token is a target exactly once, and documents are packed across
    window boundaries, separated by the end-of-text token.
    """

    kind = "text"

    def __init__(self, path: Path, meta: dict, seq_len: int, tokenizer_path: Path) -> None:
        self.path = path
        self.seq_len = seq_len
        self.vocab_size: int = meta["vocab_size"]
        self.eos_id: int = meta["eos_id"]
        self.tokens_per_sample: int = seq_len
        self.tokenizer_path = tokenizer_path
        self.tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
        self._len = (len(self.tokens) - 1) // seq_len
        self._window = np.arange(seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self._len

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 [B, seq_len]; targets are inputs shifted by one."""
        idx = sample_indices(indices, self._len)
        windows = np.asarray(self.tokens[idx[:, None] * self.seq_len + self._window], np.int64)
        batch = torch.from_numpy(windows)
        return batch[:, :-1], batch[:, 1:]

    def tokenizer(self):  # -> tokenizers.Tokenizer
        """The BPE tokenizer that produced the tokens (for decoding samples)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_path))


def prepare_text(spec: DataSpec) -> tuple[Path, dict]:
    """Build the corpus cache if missing; return its directory and meta. Checks sizes."""
    source = resolve_source(spec)
    out = spec.cache_root() / f"{source.label}-{_cache_key(spec, source)}"
    meta = read_meta(out)
    if meta is not None and (damage := _damage(out, meta)):
        _say(f"the token cache {out} is damaged ({damage}): rebuilding it")
        meta = None
    if meta is None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            lock = open(out / ".lock", "a")  # noqa: SIM115 - held for the whole build below
        except OSError as exc:
            raise DataError(
                f"the data cache {str(out)!r} cannot be written: {exc}. Fix: set "
                "data.cache_dir or $SHARDWISE_CACHE to a writable directory."
            ) from exc
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
            meta = read_meta(out)  # another process may have built it while we waited
            if meta is None or _damage(out, meta):
                meta = _build(spec, source, out)
    check_vocab(spec, meta)
    check_skipped(*meta.get("skipped_rows", (0, [])), spec.text_field, spec.max_bad_rows)
    _check_size(spec, meta, "train")
    if spec.val_fraction > 0:
        _check_size(spec, meta, "val")
    return out, meta


def load_tokens(spec: DataSpec, split: str) -> TokenDataset:
    """The train or val split of a text corpus (built on first use)."""
    out, meta = prepare_text(spec)
    if split == "val" and spec.val_fraction <= 0:
        raise DataError(
            f"data.val_fraction={spec.val_fraction} holds nothing out, so there is no 'val' "
            "split. Fix: set data.val_fraction > 0, e.g. 0.02."
        )
    return TokenDataset(out / f"{split}.bin", meta, spec.seq_len, out / "tokenizer.json")


def _cache_key(spec: DataSpec, source: Source) -> str:
    import tokenizers

    ident = {
        "format": FORMAT_VERSION,
        "tokenizers": tokenizers.__version__,  # a new BPE implementation may merge differently
        "files": source.identity(),
        # a trained BPE depends on its target size; a given tokenizer only on its files
        # "whole": documents never truncated or padded (pretrained.whole_documents; caches
        # of a tokenizer saved with truncation on were cut short before it)
        **(
            {"tokenizer": content_key(spec.tokenizer), "documents": "whole"}
            if spec.tokenizer
            else {"vocab_size": spec.vocab_size}
        ),
        "val_fraction": spec.val_fraction,
        "text_field": spec.text_field,
    }
    blob = json.dumps(ident, sort_keys=True).encode("utf-8")
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def _damage(out: Path, meta: dict) -> str | None:
    """What of the cache at `out` disagrees with its meta.json (a token file cut short or
    grown, the tokenizer gone), or None: a truncated train.bin would otherwise train on its
    remaining tokens without a word."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        path, want = out / f"{split}.bin", meta[f"{split}_tokens"] * itemsize
        size = path.stat().st_size if path.is_file() else None
        if size != want:
            held = "is missing" if size is None else f"holds {size:,} bytes"
            tokens = meta[f"{split}_tokens"]
            return f"{path.name} {held}, its meta.json says {want:,} ({tokens:,} tokens)"
    if not (out / "tokenizer.json").is_file():
        return "tokenizer.json is missing"
    return None


def _build(spec: DataSpec, source: Source, out: Path) -> dict:
    """Read and split the corpus, train or load its tokenizer, encode both splits into
    `out`, then write meta.json (last: the marker of a complete cache)."""
    start = time.perf_counter()
    train, val, skipped = _read_split(spec, source, out)
    read = time.perf_counter()
    n_chars = sum(map(len, train))
    what = "stdlib sources" if source.is_stdlib else f"{spec.dataset!r}"
    docs = f"{len(train)} train / {len(val)} held-out documents; cached in {out}"
    if spec.tokenizer:
        enc = _pretrained_encoding(spec, what, docs)
    else:
        _say(
            f"training a {spec.vocab_size}-token BPE on {n_chars / 1e6:.1f} M characters of "
            f"{what} ({docs})"
        )
        enc = _bpe_encoding(train, spec.vocab_size)
    trained = time.perf_counter()
    counts = {}
    for split, texts in (("train", train), ("val", val)):
        counts[split] = _encode_to_file(enc.encode, texts, enc.dtype, out / f"{split}.bin")
    _atomic_write(out / "tokenizer.json", enc.tokenizer.to_str().encode("utf-8"))
    end = time.perf_counter()
    sizes = {"train_docs": len(train), "val_docs": len(val), "train_chars": n_chars}
    meta = _meta(spec, enc, _Built(skipped, sizes, counts, (start, read, trained, end)))
    _atomic_write(out / "meta.json", json.dumps(meta, indent=1).encode("utf-8"))  # last: marker
    _say(
        f"{counts['train'] / 1e6:.2f} M train / {counts['val'] / 1e6:.2f} M held-out tokens "
        f"in {end - start:.1f} s (reading {meta['read_s']:.1f} s, BPE {meta['bpe_train_s']:.1f} s, "
        f"encoding {meta['encode_s']:.1f} s)"
    )
    return meta


def _read_split(spec: DataSpec, source: Source, out: Path) -> tuple[list, list, list[str]]:
    """(train texts, held-out texts, ids of rows skipped) of the corpus, after removing the
    temporary files a killed build left in `out`."""
    for stale in out.glob("*.tmp*"):  # left by a build that was killed half way
        stale.unlink(missing_ok=True)
    skipped: list[str] = []
    docs = list(read_documents(source, spec.text_field, skipped))
    check_skipped(len(skipped), skipped[:3], spec.text_field, spec.max_bad_rows, say=True)
    train, val = split_documents(docs, spec.val_fraction, spec.dataset)
    return train, val, skipped


@dataclass(frozen=True)
class _Encoding:
    """The tokenizer a cache is encoded with, its ids' facts and its documents' encoder."""

    tokenizer: object  # tokenizers.Tokenizer: its JSON is the cache's tokenizer.json
    vocab: int
    eos_id: int | None
    bos_id: int | None
    encode: Callable[[list[str]], list[list[int]]]  # texts -> each one's ids, EOS included

    @property
    def dtype(self) -> type:
        """The cache's id type: the smaller unsigned integer that holds every id."""
        return np.uint16 if self.vocab < 2**16 else np.uint32


@dataclass(frozen=True)
class _Built:
    """What building a cache measured, for its meta.json."""

    skipped: list[str]  # ids of the rows skipped
    sizes: dict[str, int]  # train_docs, val_docs, train_chars
    counts: dict[str, int]  # tokens per split
    times: tuple[float, float, float, float]  # perf_counter at start, read, trained, end


def _pretrained_encoding(spec: DataSpec, what: str, docs: str) -> _Encoding:
    """The encoding of `data.tokenizer`'s tokenizer (documents whole, never truncated)."""
    tok = load_tokenizer(spec.tokenizer)
    _say(f"encoding {what} with the tokenizer of {spec.tokenizer} ({len(tok)} tokens; {docs})")
    eos_id = tok.eos_token_id
    whole = whole_documents(tok)  # once: rebuilding it per chunk re-parses its JSON

    def encode(texts: list[str]) -> list[list[int]]:
        return encode_documents(whole, eos_id, texts)

    return _Encoding(tok.backend_tokenizer, len(tok), eos_id, tok.bos_token_id, encode)


def _bpe_encoding(train: list[str], vocab_size: int) -> _Encoding:
    """The encoding of a byte-level BPE trained on the training documents."""
    tokenizer = _train_bpe(train, vocab_size)
    eos_id = tokenizer.token_to_id(EOS)

    def encode(texts: list[str]) -> list[list[int]]:
        return encode_documents(tokenizer, eos_id, texts, specials=False)

    return _Encoding(tokenizer, tokenizer.get_vocab_size(), eos_id, None, encode)


def _meta(spec: DataSpec, enc: _Encoding, built: _Built) -> dict:
    """meta.json of a cache: what it was built from, its sizes and the stages' seconds."""
    start, read, trained, end = built.times
    skipped, counts = built.skipped, built.counts
    return {
        "format": FORMAT_VERSION,
        "dataset": spec.dataset,
        "tokenizer": spec.tokenizer or "bpe",
        "vocab_size": enc.vocab,
        "eos_id": enc.eos_id,
        "bos_id": enc.bos_id,
        "dtype": np.dtype(enc.dtype).name,
        "skipped_rows": [len(skipped), skipped[:3]],  # (checked again on every use)
        **built.sizes,
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "read_s": round(read - start, 2),
        "bpe_train_s": round(trained - read, 2),
        "encode_s": round(end - trained, 2),
    }


def _train_bpe(texts: list[str], vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # GPT-2 style byte-level BPE: every string is encodable, no unknown token needed.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    subset = list(_take_chars(texts, BPE_TRAIN_CHARS))
    tokenizer.train_from_iterator(subset, trainer, length=len(subset))
    return tokenizer


def _take_chars(texts: list[str], budget: int) -> Iterator[str]:
    """The first documents (in corpus order, so deterministic) up to `budget` characters."""
    for text in texts:
        if budget <= 0:
            return
        yield text[:budget]
        budget -= len(text)


def _encode_to_file(encode, texts: list[str], dtype, path: Path) -> int:
    """Encode documents in chunks (`encode`: texts -> each one's ids, its end-of-text token
    included) into a flat binary array."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    total = 0
    with open(tmp, "wb") as f:
        for chunk in _chunks(texts, ENCODE_CHUNK_CHARS):
            flat = [i for ids in encode(chunk) for i in ids]
            np.asarray(flat, dtype=dtype).tofile(f)
            total += len(flat)
    os.replace(tmp, path)
    return total


def _chunks(texts: list[str], max_chars: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= max_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _check_size(spec: DataSpec, meta: dict, split: str) -> None:
    n = meta[f"{split}_tokens"]
    if n < spec.seq_len + 1:
        hint = f"at most {n - 1}" if n > 1 else "more data"
        raise DataError(
            f"data.dataset={spec.dataset!r} gives only {n} {split} tokens, fewer than one sample "
            f"of data.seq_len+1={spec.seq_len + 1}. Fix: use a smaller data.seq_len ({hint}) "
            f"or more data" + (", or a larger data.val_fraction." if split == "val" else ".")
        )


def _say(message: str) -> None:
    print(f"shardwise: {message}", file=sys.stderr, flush=True)
