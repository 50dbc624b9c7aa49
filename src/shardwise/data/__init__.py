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
    prepare_text(spec)


def load_data(spec: DataSpec, split: str) -> TokenDataset | ImageDataset:
    """The "train" or "val" split of `spec.dataset` (prepares the cache first if needed)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if spec.dataset == "digits":
        return load_digits(spec, split)
    return load_tokens(spec, split)
