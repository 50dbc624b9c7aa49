"""Prepared corpora (`shardwise data prepare`): the manifest and the samples over its shards.

A prepared directory holds token shards (`train-00000.bin`, ..., `val-00000.bin`, flat uint16
or uint32 arrays), the tokenizer that wrote them (`tokenizer.json`) and `manifest.json`,
written last. The train split is the concatenation of its shards in order and equals, token
for token, the `train.bin` the token cache (data/tokens.py) builds from the same corpus,
tokenizer and held-out fraction; so are the windows, and so the losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from shardwise.data.corpus import DataSpec
from shardwise.data.pretrained import check_vocab, content_key
from shardwise.data.tokens import TokenDataset, sample_indices
from shardwise.errors import DataError

MANIFEST = "manifest.json"
PARTIAL = "manifest.partial.json"  # the plan and the shards done so far, while preparing
KIND = "shardwise-prepared"
VERSION = 1


def is_prepared(path: str | Path) -> bool:
    """Whether `path` is a directory `shardwise data prepare` finished (it has the manifest)."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / MANIFEST).is_file()


def read_manifest(root: str | Path) -> dict:
    """The manifest of the prepared directory `root`; DataError if it is not one."""
    path = Path(root).expanduser() / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{str(path)!r} cannot be read as a prepared corpus's manifest: {exc}. Fix: "
            "prepare the corpus again with `shardwise data prepare INPUT... --out NEW_DIR`."
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise DataError(
            f"{str(path)!r} is not a manifest `shardwise data prepare` wrote. Fix: point "
            "data.dataset at a directory that command prepared."
        )
    if manifest.get("version") != VERSION:
        raise DataError(
            f"{str(path)!r} has manifest version {manifest.get('version')}; this shardwise reads "
            f"version {VERSION}. Fix: prepare the corpus again with this version."
        )
    return manifest


class ShardedTokenDataset(TokenDataset):
    """TokenDataset's samples over several memory-mapped shards read as one array: sample i
    is tokens[i*S : i*S + S + 1] of the shards' concatenation, so a window may span the end of
    one shard and the start of the next."""

    def __init__(self, root: Path, manifest: dict, split: str, seq_len: int) -> None:
        shards = manifest["splits"][split]["shards"]
        dtype = np.dtype(manifest["dtype"])
        self.path = root
        self.seq_len = seq_len
        self.vocab_size = manifest["tokenizer"]["vocab_size"]
        self.eos_id = manifest["tokenizer"]["eos_id"]
        self.tokens_per_sample = seq_len
        self.tokenizer_path = root / "tokenizer.json"
        self.shards = [np.memmap(root / s["name"], dtype=dtype, mode="r") for s in shards]
        counts = [s["tokens"] for s in shards]
        # starts[k]: global position of shard k's first token; starts[-1]: the total
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._len = max(int(self.starts[-1]) - 1, 0) // seq_len
        self._window = np.arange(seq_len + 1, dtype=np.int64)

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 [B, seq_len]; targets are inputs shifted by one."""
        idx = sample_indices(indices, self._len)
        pos = idx[:, None] * self.seq_len + self._window
        which = np.searchsorted(self.starts, pos, side="right") - 1
        windows = np.empty(pos.shape, dtype=np.int64)
        for k in np.unique(which).tolist():  # a batch touches a few shards: one gather each
            here = which == k
            windows[here] = self.shards[k][pos[here] - self.starts[k]]
        batch = torch.from_numpy(windows)
        return batch[:, :-1], batch[:, 1:]


def check_prepared(spec: DataSpec, root: Path, manifest: dict) -> None:
    """Refuse a prepared corpus that does not fit the run: another held-out fraction or
    tokenizer than the config's, a vocabulary past the model's, a shard cut short, too few
    tokens for one sample."""
    where = f"data.dataset={str(root)!r}"
    if spec.format != "text" or spec.label_field:
        what = f"data.format={spec.format}" if spec.format != "text" else "a classifier"
        raise DataError(
            f"{where} holds packed token shards, not {what}'s records. Fix: point data.dataset "
            "at the raw records, or train a text model (data.format=text) on it."
        )
    tok = manifest["tokenizer"]
    if spec.tokenizer and tok.get("content_key") != content_key(spec.tokenizer):
        raise DataError(
            f"{where} was prepared with the tokenizer {tok.get('source')!r}, but this run "
            f"encodes with the one in {spec.tokenizer!r}: the ids would mean other tokens. "
            f"Fix: prepare it with --tokenizer {spec.tokenizer}, or train with "
            f"--data.tokenizer={tok.get('source') if tok['kind'] == 'hf' else 'bpe'}."
        )
    if manifest["val_fraction"] != spec.val_fraction:
        raise DataError(
            f"data.val_fraction={spec.val_fraction} but {where} was prepared with "
            f"--val-fraction {manifest['val_fraction']}, which fixed its held-out documents. "
            f"Fix: --data.val_fraction={manifest['val_fraction']}, or prepare it again with "
            f"--val-fraction {spec.val_fraction}."
        )
    check_vocab(spec, {"vocab_size": tok["vocab_size"], "tokenizer": tok.get("source")})
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in ("train", "val"):
        for shard in manifest["splits"][split]["shards"]:
            path = root / shard["name"]
            size = path.stat().st_size if path.is_file() else None
            if size != shard["tokens"] * itemsize:
                held = "is missing" if size is None else f"holds {size:,} bytes"
                raise DataError(
                    f"{where} is damaged: {shard['name']} {held}, its manifest says "
                    f"{shard['tokens'] * itemsize:,}. Fix: prepare the corpus again into a new "
                    "--out directory."
                )
    for split in ("train", "val") if spec.val_fraction > 0 else ("train",):
        n = manifest["splits"][split]["tokens"]
        if n < spec.seq_len + 1:
            raise DataError(
                f"{where} holds only {n} {split} tokens, fewer than one sample of "
                f"data.seq_len+1={spec.seq_len + 1}. Fix: a smaller data.seq_len or more data."
            )


def load_prepared(spec: DataSpec, split: str, root: str | None = None) -> ShardedTokenDataset:
    """The train or val split of the prepared directory `root` (default: spec.dataset)."""
    path = Path(root or spec.dataset).expanduser().resolve()
    manifest = read_manifest(path)
    check_prepared(spec, path, manifest)
    if split == "val" and not manifest["splits"]["val"]["shards"]:
        raise DataError(
            f"data.dataset={str(path)!r} holds nothing out (prepared with --val-fraction 0), so "
            "there is no 'val' split. Fix: prepare it with --val-fraction > 0, e.g. 0.02."
        )
    return ShardedTokenDataset(path, manifest, split, spec.seq_len)
