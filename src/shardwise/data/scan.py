"""The held-out split and the shard plan of `shardwise data prepare`, one document at a time.

`corpus.split_documents` splits a list it holds whole; a corpus to prepare may not fit in
memory, so its documents stream past twice (or, for the corner cases below, three times):
a scan that decides each document's split, sizes the shards and keeps the first documents
the BPE trains on, then the encoding pass (data/prepare.py), which splits them again by the
same rule. The rule is split_documents', decided per document: a document is held out when
the stable hash of its id is below val_fraction; when no document's is, the one with the
smallest hash is held out, when all are, the one with the largest trains; a corpus of one
document holds out its tail (`corpus.cut_single`). The corner cases are known only once the
scan has seen every document, so a scan that finds one is repeated with the rule it found.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from shardwise.data.corpus import cut_single, stable_unit


@dataclass(frozen=True)
class Rule:
    """Which split each document goes to (see the module's docstring)."""

    val_fraction: float
    single: bool = False  # the corpus is one document: its tail is held out
    forced_val: int = -1  # the document held out although its hash is not below val_fraction
    forced_train: int = -1  # the document trained on although its hash is below it

    def assign(self, docs: Iterable[tuple[str, str]], seen: Seen | None = None) -> Iterator:
        """(split, text) of every document of `docs` in order; `seen` counts them."""
        for i, (doc_id, text) in enumerate(docs):
            if self.val_fraction <= 0:
                yield "train", text
                continue
            unit = stable_unit(doc_id)
            if seen is not None:
                seen.add(i, unit, unit < self.val_fraction)
            if self.single:
                head, tail = cut_single(text, self.val_fraction)
                yield "train", head
                yield "val", tail
            elif i == self.forced_val or (unit < self.val_fraction and i != self.forced_train):
                yield "val", text
            else:
                yield "train", text


@dataclass
class Seen:
    """What a scan learns of the documents' hashes: enough to fix the rule's corner cases."""

    count: int = 0
    any_val: bool = False
    all_val: bool = True
    lowest: tuple[float, int] = (2.0, -1)  # (hash, index): the first of the smallest
    highest: tuple[float, int] = (-1.0, -1)  # the first of the largest

    def add(self, i: int, unit: float, val: bool) -> None:
        self.count += 1
        self.any_val |= val
        self.all_val &= val
        if unit < self.lowest[0]:
            self.lowest = (unit, i)
        if unit > self.highest[0]:
            self.highest = (unit, i)

    def rule(self, val_fraction: float) -> Rule:
        """split_documents' rule for the documents seen."""
        if val_fraction <= 0:
            return Rule(val_fraction)
        if self.count == 1:
            return Rule(val_fraction, single=True)
        if not self.any_val:
            return Rule(val_fraction, forced_val=self.lowest[1])
        if self.all_val:
            return Rule(val_fraction, forced_train=self.highest[1])
        return Rule(val_fraction)


@dataclass
class Scan:
    """A scan's result: the shard plan, the BPE's training text, the train characters."""

    plan: list[dict]
    rule: Rule
    sample: list[str] = field(default_factory=list)
    train_chars: int = 0


def scan(docs: Iterable[tuple[str, str]], rule: Rule, shard_mb: float, sample_chars: int) -> Scan:
    """Plan the shards of `docs` split by `rule`: consecutive runs of whole documents of each
    split, each about `shard_mb` MB of text, named `{split}-{k:05d}.bin`, the train split's
    first; keep the first `sample_chars` characters of training documents (tokens.py's
    `_take_chars`: the text a BPE trains on). The returned rule is the one the documents
    call for: when it differs from `rule`, scan again with it."""
    budget = max(1, int(shard_mb * 1e6))
    shards: dict[str, list[dict]] = {"train": [], "val": []}
    start, size, n = {"train": 0, "val": 0}, {"train": 0, "val": 0}, {"train": 0, "val": 0}
    seen, sample, left, chars = Seen(), [], sample_chars, 0
    for split, text in rule.assign(docs, seen):
        n[split] += 1
        size[split] += len(text)
        if split == "train":
            chars += len(text)
            if left > 0:
                sample.append(text[:left])
                left -= len(text)
        if size[split] >= budget:
            shards[split].append(_shard(split, len(shards[split]), start[split], n[split]))
            start[split], size[split] = n[split], 0
    for split in shards:  # the last run of each split, short of the budget
        if start[split] < n[split]:
            shards[split].append(_shard(split, len(shards[split]), start[split], n[split]))
    found = seen.rule(rule.val_fraction) if seen.count else rule
    return Scan(shards["train"] + shards["val"], found, sample, chars)


def _shard(split: str, k: int, start: int, stop: int) -> dict:
    return {"name": f"{split}-{k:05d}.bin", "split": split, "start": start, "stop": stop}
