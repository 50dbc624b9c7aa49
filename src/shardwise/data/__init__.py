"""Real training data without downloads: text corpora, digits images and the global sampler.

`prepare_data(spec)` builds caches once (safe to call from every rank at once);
`load_data(spec, split)` returns a dataset with `get_batch(indices)`; `GlobalSampler` and
`split_for_rank` decide which indices each rank reads at each step.
"""

from __future__ import annotations

from shardwise.data.corpus import DataSpec
from shardwise.data.images import ImageDataset, load_digits
from shardwise.data.sampler import GlobalSampler, split_for_rank
from shardwise.data.tokens import TokenDataset, load_tokens, prepare_text
from shardwise.data.user import UserDataset, load_user

__all__ = [
    "DataSpec",
    "GlobalSampler",
    "ImageDataset",
    "TokenDataset",
    "load_data",
    "prepare_data",
    "split_for_rank",
]

SPLITS = ("train", "val")


def prepare_data(spec: DataSpec) -> None:
    """Build every cache `spec` needs (tokenizer, token arrays) if missing.

    Idempotent and safe when several processes call it at once (file lock, atomic writes).
    Raises DataError for missing, empty, unreadable or too-small data.
    """
    if spec.dataset == "digits":
        return  # bundled with scikit-learn and tiny: loaded in memory, nothing to cache
    if spec.is_user:  # your dataset: imported and its first item read, nothing to cache
        load_user(spec.dataset, "train")
        return
    prepare_text(spec)


def load_data(spec: DataSpec, split: str) -> TokenDataset | ImageDataset | UserDataset | None:
    """The "train" or "val" split of `spec.dataset` (prepares the cache first if needed)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if spec.dataset == "digits":
        return load_digits(spec, split)
    if spec.is_user:
        return load_user(spec.dataset, split)  # None when your factory has no such split
    return load_tokens(spec, split)
