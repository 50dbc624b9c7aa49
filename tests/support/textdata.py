"""Small random text corpora and the DataSpec that reads them, for the data tests."""

from __future__ import annotations

import random
from pathlib import Path

from shardwise.data import DataSpec

WORDS = ["the", "a", "data", "model", "rank", "shard", "tensor", "batch", "loss", "step", "mesh"]


def text(seed: int, n_words: int) -> str:
    """About `n_words` words of WORDS, twelve a line, drawn from `seed`."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choices(WORDS, k=12)) for _ in range(n_words // 12)]
    return "\n".join(lines) + "\n"


def spec(tmp_path: Path, dataset: Path | str, **kw) -> DataSpec:
    """A small-vocabulary DataSpec of `dataset` with its cache under `tmp_path`."""
    kw = {"seq_len": 16, "vocab_size": 300, "cache_dir": str(tmp_path / "cache"), **kw}
    return DataSpec(dataset=str(dataset), **kw)
