"""Labelled text for sequence classification (`model.task=classification`).

Rows of .jsonl / .json / .csv / .parquet files give a text (`data.text_field`) and a label
(`data.label_field`: ints or strings). Rows are split into train and held-out by the stable
hash of their id (corpus.split_documents: never random per run); the labels are the sorted
distinct training labels (ints in numeric order), and a held-out label outside them is an
error. Texts are encoded by the checkpoint's own tokenizer, truncated and padded to
data.seq_len with its attention mask, once per (files, tokenizer content, fields, seq_len) in
a cache, like the token corpora. A sample is one row: the loss is divided by the global
number of rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from shardwise.data.cache import build_once, read_meta, save_array
from shardwise.data.columns import builder_of, load_column
from shardwise.data.corpus import DataSpec, resolve_source, split_documents
from shardwise.data.pretrained import check_vocab, load_tokenizer, tokenized_key
from shardwise.errors import DataError

FORMAT = 1


class ClassifyDataset:
    kind = "classification"
    tokens_per_sample = 1

    def __init__(self, root: Path, split: str, meta: dict) -> None:
        self.ids = np.load(root / f"{split}.ids.npy", mmap_mode="r")
        self.mask = np.load(root / f"{split}.mask.npy", mmap_mode="r")
        self.labels = np.load(root / f"{split}.labels.npy")
        self.label_names: list[str] = meta["labels"]
        self.vocab_size: int = meta["vocab_size"]

    def __len__(self) -> int:
        return len(self.labels)

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids and attention mask packed as [B, 2, S] int64, labels [B] int64)."""
        idx = torch.as_tensor(indices, dtype=torch.int64).numpy()
        packed = np.stack([self.ids[idx], self.mask[idx]], axis=1).astype(np.int64)
        return torch.from_numpy(packed), torch.from_numpy(self.labels[idx].astype(np.int64))


def _rows(spec: DataSpec) -> tuple[list, list]:
    """(train rows, held-out rows), each row (text, label as read)."""
    source = resolve_source(spec)
    if source.is_stdlib:
        raise DataError(
            "model.task=classification needs labelled rows, and data.dataset=stdlib has none. "
            "Fix: a .jsonl/.csv/.parquet file with a text and a label column."
        )
    docs = []
    for path, rel in zip(source.files, source.ids, strict=True):
        builder = builder_of(path.suffix.lower())
        texts = load_column(path, builder, spec.text_field)
        labels = load_column(path, builder, spec.label_field, "data.label_field")
        if builder == "json":  # pyarrow turns mixed JSON types into strings: check the source
            check_label_types(path, spec.label_field)
        for i, (text, label) in enumerate(zip(texts, labels, strict=True)):
            if label is None or not isinstance(text, str) or not text:
                raise DataError(
                    f"row {i} of '{path}' has no text or no label ({spec.text_field}={text!r}, "
                    f"{spec.label_field}={label!r}). Fix: fill or drop that row."
                )
            docs.append((f"{rel}#{i}", json.dumps([text, label])))
    train, val = split_documents(docs, spec.val_fraction, spec.dataset)
    return [json.loads(r) for r in train], [json.loads(r) for r in val]


def check_label_types(path: Path, field: str) -> None:
    """Refuse a JSON / JSON lines file whose labels mix types (1, "1", 1.0, "two"): read as
    strings they would be distinct classes, some spelt with literal quotes."""
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".jsonl" or not text.lstrip().startswith("["):
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            rows = json.loads(text)
    except ValueError:  # a layout datasets reads and this check does not: nothing to compare
        return
    first: dict[str, object] = {}  # type name -> its first value
    for row in rows:
        value = row.get(field) if isinstance(row, dict) else None
        if value is not None:
            first.setdefault(type(value).__name__, value)
    if len(first) > 1:
        shown = ", ".join(f"{json.dumps(v)} ({t})" for t, v in first.items())
        raise DataError(
            f"data.label_field={field!r} mixes label types in '{path}': {shown}; they would "
            "be read as different classes. Fix: write every label the same way (all integers "
            'or all strings, e.g. 1 or "1" throughout).'
        )


def _names(train: list) -> list[str]:
    values = {label for _, label in train}
    ordered = (
        sorted(values) if all(isinstance(v, int) for v in values) else sorted(map(str, values))
    )
    return [str(v) for v in ordered]


def label_names(spec: DataSpec) -> tuple[str, ...]:
    """The labels of the data, in id order (read from the cache when it is built)."""
    meta = _cached(spec)
    if meta is not None:
        return tuple(meta["labels"])
    train, _ = _rows(spec)
    return tuple(_names(train))


def _key(spec: DataSpec) -> str:
    return tokenized_key(spec, FORMAT, [spec.text_field, spec.label_field])


def _root(spec: DataSpec) -> Path:
    if not spec.tokenizer:
        raise DataError(
            "model.task=classification encodes text with the checkpoint's tokenizer, and none "
            "is set. Fix: --model.init_from=DIR holding one (data.tokenizer=auto), or "
            "--data.tokenizer=DIR."
        )
    return spec.cache_root() / f"classify-{_key(spec)}"


def _cached(spec: DataSpec) -> dict | None:
    return read_meta(_root(spec))


def prepare_classify(spec: DataSpec) -> tuple[Path, dict]:
    """Build the encoded rows once (data/cache.py)."""
    root = _root(spec)
    meta = build_once(root, lambda r: _build(spec, r))
    check_vocab(spec, meta)
    return root, meta


def _build(spec: DataSpec, root: Path) -> dict:
    train, val = _rows(spec)
    names = _names(train)
    index = {name: i for i, name in enumerate(names)}
    unseen = sorted({str(label) for _, label in val} - set(index))
    if unseen:
        raise DataError(
            f"the held-out rows of '{spec.dataset}' have label(s) {unseen[:5]} that no training "
            f"row has (training labels: {names[:10]}). Fix: more rows of those labels, or a "
            "data.val_fraction that keeps each label in training."
        )
    tok = load_tokenizer(spec.tokenizer)
    for split, rows in (("train", train), ("val", val)):
        enc = tok(
            [text for text, _ in rows],
            truncation=True,
            max_length=spec.seq_len,
            padding="max_length",
            return_attention_mask=True,
        )
        dtype = np.int32 if len(tok) >= 2**15 else np.int16
        save_array(root / f"{split}.ids.npy", np.asarray(enc["input_ids"], dtype=dtype))
        save_array(root / f"{split}.mask.npy", np.asarray(enc["attention_mask"], dtype=np.int8))
        labels = np.asarray([index[str(y)] for _, y in rows], np.int64)
        save_array(root / f"{split}.labels.npy", labels)
    return {
        "format": FORMAT,
        "labels": names,
        "vocab_size": len(tok),
        "train_rows": len(train),
        "val_rows": len(val),
        "tokenizer": spec.tokenizer,
    }


def load_classify(spec: DataSpec, split: str) -> ClassifyDataset | None:
    root, meta = prepare_classify(spec)
    if split == "val" and meta["val_rows"] == 0:
        return None
    return ClassifyDataset(root, split, meta)
