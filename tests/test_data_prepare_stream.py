"""`shardwise data prepare` streams: a corpus many times larger than one encoding chunk gives
the tokens the in-memory token cache gives, while the documents alive at any moment stay
bounded by the chunk size and the worker count, counted object by object."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import numpy as np
import pytest

import shardwise.data.prepare as prep
from shardwise.data.tokens import load_tokens
from support.compare import VOCAB
from support.textdata import spec as _spec
from support.textdata import text as _text
from test_data_prepare import _hf_tokenizer, _prepare, _stream

CHUNK = 1500  # characters per encoding chunk here: ~3 of the documents below
WORKERS = 2


class _Doc(str):
    """A document's text whose life is counted (a str subclass: the encoder takes it as is)."""


class _Census:
    """How many documents read are alive now, and at most."""

    def __init__(self) -> None:
        self.alive = self.most = self.read = 0

    def wrap(self, docs):
        for doc_id, text in docs:
            doc = _Doc(text)
            self.alive += 1
            self.read += 1
            self.most = max(self.most, self.alive)
            weakref.finalize(doc, self._gone)
            yield doc_id, doc
            del doc, text  # the reader keeps no reference of its own

    def _gone(self) -> None:
        self.alive -= 1


def _big_corpus(root: Path) -> Path:
    """180 documents (150 .txt files and a .jsonl of 30 rows), ~500 characters each."""
    root.mkdir(parents=True)
    for i in range(150):
        (root / f"d{i:03d}.txt").write_text(_text(3000 + i, 84))
    rows = [{"text": _text(4000 + i, 84)} for i in range(30)]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    return _big_corpus(tmp_path_factory.mktemp("big") / "corpus")


@pytest.mark.parametrize("tokenizer", ["hf", "bpe"])
def test_a_corpus_larger_than_a_chunk_streams_with_few_documents_alive(
    big, tmp_path, monkeypatch, tokenizer
):
    """With 1,500-character chunks and two workers, a corpus of ~90,000 characters (60
    chunks) prepares to exactly the token cache's train and val arrays (the in-memory
    reference), and no more than (2 per worker in flight + 1 filling per split) chunks'
    documents are alive at once, though every document is read twice (scan, encode). The
    BPE's training text is a copy of at most its first BPE_TRAIN_CHARS characters."""
    census = _Census()
    read = prep.documents
    monkeypatch.setattr(prep, "documents", lambda *a: census.wrap(read(*a)))
    monkeypatch.setattr(prep, "CHUNK_CHARS", CHUNK)
    tok = str(_hf_tokenizer(tmp_path / "tok")) if tokenizer == "hf" else ""
    out = tmp_path / "out"
    m = _prepare([big], out, tokenizer=tok, shard_mb=0.02, workers=WORKERS)
    docs = m["splits"]["train"]["docs"] + m["splits"]["val"]["docs"]
    assert docs == 180 and census.read == 2 * docs
    chars = sum(len(f.read_text()) for f in big.glob("*.txt"))
    shortest = min(len(f.read_text()) for f in big.glob("*.txt"))
    assert chars > 40 * CHUNK  # the corpus is many chunks
    per_chunk = CHUNK // shortest + 1  # a chunk closes at the document that reaches CHUNK
    bound = (2 * WORKERS + 2) * per_chunk + 1  # (+1: the document being read)
    assert census.most <= bound < docs / 4, (census.most, bound)
    spec = _spec(tmp_path, big, vocab_size=VOCAB, **({"tokenizer": tok} if tok else {}))
    for split in ("train", "val"):
        want = np.asarray(load_tokens(spec, split).tokens)
        assert np.array_equal(_stream(out, m, split), want)
    assert len(m["splits"]["train"]["shards"]) >= 4  # chunks cut within and across shards


def test_one_worker_holds_one_chunk_per_split(big, tmp_path, monkeypatch):
    """In one process the bound is tighter: a chunk is encoded as soon as it closes, so at
    most one filling chunk per split (and the one just handed over) is alive."""
    census = _Census()
    read = prep.documents
    monkeypatch.setattr(prep, "documents", lambda *a: census.wrap(read(*a)))
    monkeypatch.setattr(prep, "CHUNK_CHARS", CHUNK)
    tok = str(_hf_tokenizer(tmp_path / "tok"))
    m = _prepare([big], tmp_path / "out", tokenizer=tok, shard_mb=0.02, workers=1)
    shortest = min(len(f.read_text()) for f in big.glob("*.txt"))
    assert census.most <= 3 * (CHUNK // shortest + 1) + 1, census.most
    monkeypatch.undo()
    whole = _prepare([big], tmp_path / "whole", tokenizer=tok, shard_mb=0.02, workers=1)
    assert m["splits"] == whole["splits"]  # (default chunk: the whole corpus is one)
