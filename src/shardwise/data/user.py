"""Your own dataset: `data.dataset=module:factory` or `file.py:factory`.

`factory(split)` is called with "train" and "val" and returns a map-style dataset (`len()` and
`[i]`) of `(input, target)` pairs, or None when there is no such split. The global sampler
decides which indices each rank reads at each step, so the data order is the same in every
layout; items are stacked with torch's `default_collate`. Each item counts as one sample: the
summed loss of a step is divided by the global batch size.
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from shardwise.data.callables import resolve
from shardwise.errors import DataError


class UserDataset:
    kind = "user"
    tokens_per_sample = 1

    def __init__(self, data, source: str, split: str) -> None:
        self.data, self.source, self.split = data, source, split
        self._len = _length(data, source, split)

    def __len__(self) -> int:
        return self._len

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.data[int(i)] for i in torch.as_tensor(indices).tolist()]
        if not all(isinstance(x, (tuple, list)) and len(x) == 2 for x in items):
            raise DataError(
                f"data.dataset='{self.source}' ({self.split}) item {int(indices[0])} is "
                f"{type(items[0]).__name__}, not an (input, target) pair. Fix: return "
                "(input, target) from __getitem__."
            )
        inputs, targets = default_collate(items)
        return inputs, targets


def _length(data, source: str, split: str) -> int:
    try:
        n = len(data)
    except TypeError:
        raise DataError(
            f"data.dataset='{source}' returned a {type(data).__name__} for '{split}', which has "
            "no len(). Fix: return a map-style dataset (torch.utils.data.Dataset, a list, ...)."
        ) from None
    if n == 0:
        raise DataError(f"data.dataset='{source}' returned no '{split}' samples. Fix: add some.")
    return n


def load_user(source: str, split: str) -> UserDataset | None:
    """The `split` of your dataset (None: it has none; a 'train' split is required)."""
    factory = resolve(source, "data.dataset")
    try:
        data = factory(split)
    except Exception as exc:
        raise DataError(
            f"data.dataset='{source}' failed for split '{split}': {type(exc).__name__}: {exc}. "
            "Fix: factory(split) with split 'train' or 'val' returns a dataset or None."
        ) from None
    if data is None:
        if split == "train":
            raise DataError(f"data.dataset='{source}' returned None for 'train'. Fix: return data.")
        return None
    dataset = UserDataset(data, source, split)
    dataset.get_batch(torch.tensor([0]))  # the first item: a pair that stacks
    return dataset
