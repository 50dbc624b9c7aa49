"""Weighted blends of text corpora: `data.blend = "dirA:0.7,dirB:0.3"`.

Each source is a prepared directory (data/shards.py) or a raw corpus (anything data.dataset
takes but `digits` and your own factory), all with one tokenizer. Sample i of the blend is
a fixed function of i: source s's j-th sample is given the time (j + 1/2) / w_s and the blend
takes every source's samples in order of time (ties: the earlier source). This is the
Sainte-Laguë (Webster) divisor method of apportionment: after any i samples each source's
count is within (k + 1) / 2 of w_s * i (k sources), and the counts only grow with i, so a
prefix of the blend is the blend of a shorter run. The global sampler permutes blend indices
by (seed, step) as for any dataset, so a blend resumes mid-epoch in any layout.

A blend epoch is long enough that every source's samples are drawn at least about once:
N = max_s ceil(len_s / w_s); a source weighted above its share of the data repeats (its j-th
draw is its sample j mod len_s).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from shardwise.data.corpus import DataSpec
from shardwise.data.identity import vocab_key
from shardwise.data.shards import is_prepared, load_prepared
from shardwise.data.tokens import TokenDataset, load_tokens, sample_indices
from shardwise.errors import DataError

_FORM = "Fix: data.blend='PATH:WEIGHT,PATH:WEIGHT', e.g. 'dirA:0.7,dirB:0.3'."


def parse_blend(text: str) -> list[tuple[str, float]]:
    """(source, normalised weight) of each entry of `data.blend`; DataError if malformed."""
    entries = []
    for part in text.split(","):
        path, sep, raw = part.strip().rpartition(":")
        if not sep or not path.strip():
            raise DataError(f"data.blend entry {part.strip()!r} is not PATH:WEIGHT. {_FORM}")
        try:
            weight = float(raw)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight) or weight <= 0:
            raise DataError(
                f"data.blend weight {raw.strip()!r} of {path.strip()!r} must be a number > 0. "
                f"{_FORM}"
            )
        entries.append((path.strip(), weight))
    names = [p for p, _ in entries]
    if len(set(names)) < len(names):
        twice = next(p for p in names if names.count(p) > 1)
        raise DataError(
            f"data.blend names {twice!r} twice. Fix: one entry per source, its weights summed."
        )
    total = sum(w for _, w in entries)
    return [(p, w / total) for p, w in entries]


def _draws_before(w: float, t: np.ndarray, s: int, other: int) -> np.ndarray:
    """How many draws of source `other` (weight `w`) come before source `s`'s draw of time
    `t`: times (j + 1/2) / w below t, or equal to it from an earlier source. The estimate
    ceil(w·t - 1/2) is corrected against the same float times the order is defined by."""

    def before(j: np.ndarray) -> np.ndarray:
        tj = (j + 0.5) / w
        return (tj < t) | ((tj == t) & (other < s))

    c = np.maximum(np.ceil(w * t - 0.5).astype(np.int64), 0)
    for _ in range(2):
        c = np.where(before(c), c + 1, c)
        c = np.where((c > 0) & ~before(c - 1), c - 1, c)
    return c


def locate(weights: list[float], idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, draw) of blend samples `idx`: draw j of source s is its (j+1)-th sample.
    Sample i is the draw whose count of earlier draws over all sources is i; source s's
    candidates lie within k + 2 of w_s·i (the module doc's bound), so each index costs
    O(k^3) element-wise work and nothing of the epoch is held."""
    idx = np.asarray(idx, dtype=np.int64)
    k = len(weights)
    source = np.full(idx.shape, -1, dtype=np.int64)
    draw = np.zeros(idx.shape, dtype=np.int64)
    for s, w in enumerate(weights):
        base = np.floor(w * idx).astype(np.int64)
        for d in range(-k - 2, k + 3):
            j = np.maximum(base + d, 0)
            t = (j + 0.5) / w
            rank = sum(j if o == s else _draws_before(wo, t, s, o) for o, wo in enumerate(weights))
            hit = (base + d >= 0) & (rank == idx)
            source, draw = np.where(hit, s, source), np.where(hit, j, draw)
    if (source < 0).any():  # the bound above makes this unreachable; never a wrong sample
        raise RuntimeError(f"blend sample {int(idx[source < 0][0])} not located")
    return source, draw


class BlendDataset(TokenDataset):
    """TokenDataset's samples drawn from several corpora by weight (see the module doc)."""

    def __init__(self, sources: list[TokenDataset], weights: list[float]) -> None:
        first = sources[0]
        self.path = first.path
        self.seq_len = first.seq_len
        self.vocab_size = max(s.vocab_size for s in sources)
        self.eos_id = first.eos_id
        self.tokens_per_sample = first.tokens_per_sample
        self.tokenizer_path = first.tokenizer_path
        self.sources = sources
        self.lengths = np.array([len(s) for s in sources], dtype=np.int64)
        self._len = max(math.ceil(int(n) / w) for n, w in zip(self.lengths, weights, strict=True))
        self.weights = list(weights)

    def where(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample within it) of blend samples `idx`."""
        source, draw = locate(self.weights, idx)
        return source, draw % self.lengths[source]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 [B, seq_len], each row from its source."""
        idx = sample_indices(indices, self._len)
        which, inner = self.where(idx)
        inputs = torch.empty(len(idx), self.seq_len, dtype=torch.int64)
        targets = torch.empty_like(inputs)
        for s in np.unique(which).tolist():
            here = np.nonzero(which == s)[0]
            x, y = self.sources[s].get_batch(torch.from_numpy(inner[here]))
            inputs[here], targets[here] = x, y
        return inputs, targets


def check_blend(spec: DataSpec) -> list[tuple[str, float]]:
    """The entries of `spec.blend`, refusing it beside data.dataset or for non-text data."""
    entries = parse_blend(spec.blend)
    if spec.dataset != "stdlib":  # the default: a blend names its own corpora
        raise DataError(
            f"data.blend={spec.blend!r} and data.dataset={spec.dataset!r} both name the "
            "training data. Fix: drop data.dataset (the blend names its corpora) or data.blend."
        )
    if spec.format != "text" or spec.label_field:
        what = f"data.format={spec.format}" if spec.format != "text" else "a classifier"
        raise DataError(
            f"data.blend={spec.blend!r} blends text corpora, not {what}'s records. Fix: drop "
            "data.blend, or train a text model (data.format=text)."
        )
    return entries


def load_blend(spec: DataSpec, split: str) -> BlendDataset:
    """The train or val split of every source of `spec.blend`, blended by weight."""
    entries = check_blend(spec)
    sources = [_source(spec, path, split) for path, _ in entries]
    keys = [(vocab_key(s.tokenizer_path), s.eos_id) for s in sources]
    for (path, _), key in zip(entries[1:], keys[1:], strict=True):
        if key != keys[0]:
            raise DataError(
                f"data.blend source {path!r} was tokenised with another tokenizer or vocabulary "
                f"than {entries[0][0]!r}: the same id would mean different tokens. Fix: prepare "
                "every source with one --tokenizer DIR (shardwise data prepare), or train raw "
                "corpora with --data.tokenizer=DIR."
            )
    return BlendDataset(sources, [w for _, w in entries])


def _source(spec: DataSpec, path: str, split: str) -> TokenDataset:
    if is_prepared(path):
        return load_prepared(spec, split, path)
    if path in ("digits",) or ":" in path:
        raise DataError(
            f"data.blend source {path!r} is not a text corpus. Fix: prepared directories or "
            "raw text corpora (files, directories, globs, stdlib)."
        )
    if (
        path != "stdlib"
        and not any(c in path for c in "*?[")
        and not os.path.lexists(Path(path).expanduser())
    ):
        raise DataError(
            f"data.blend source {path!r} does not exist. Fix: a directory prepared by "
            "`shardwise data prepare`, or a raw corpus (file, directory, glob, stdlib)."
        )
    return load_tokens(replace(spec, dataset=path, blend=""), split)
