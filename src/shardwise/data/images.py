"""Handwritten digits: a real, tiny image classification set bundled with scikit-learn.

1,797 grey 8x8 images (UCI optdigits), no download. They are resized to `image_size` so
that CNNs built for 32x32 inputs (ResNet-style) run unchanged, and kept in memory.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from shardwise.data.corpus import DataSpec, stable_unit

# The default text held-out fraction (2%) would leave ~36 digit images: too few for an
# accuracy worth reading, so digits hold out at least 20% (~360 images).
MIN_DIGITS_VAL_FRACTION = 0.2


class ImageDataset:
    """In-memory images [N, 1, H, W] (normalised with train statistics) and int64 labels."""

    kind = "image"
    num_classes: int = 10
    tokens_per_sample: int = 1

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor) -> None:
        self.images = images
        self.labels = labels
        self.indices = indices  # positions in sklearn's array, to check splits are disjoint
        self.image_size: int = images.shape[-1]

    def __len__(self) -> int:
        return len(self.labels)

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(images float32 [B, 1, H, W], labels int64 [B])."""
        idx = torch.as_tensor(indices, dtype=torch.int64).cpu()
        return self.images[idx], self.labels[idx]


def digits_val_fraction(spec: DataSpec) -> float:
    """The held-out fraction digits actually use: max(data.val_fraction, 0.2)."""
    return max(spec.val_fraction, MIN_DIGITS_VAL_FRACTION)


def load_digits(spec: DataSpec, split: str) -> ImageDataset:
    """The train or val split of sklearn's digits, resized to spec.image_size.

    The held-out set is the max(spec.val_fraction, 0.2) share of images with the smallest
    stable hash of their index: the same images on every run and machine.
    """
    return ImageDataset(*_digits(spec.image_size, digits_val_fraction(spec), split))


@functools.lru_cache(maxsize=4)
def _digits(image_size: int, val_fraction: float, split: str) -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    raw = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1)  # [N, 1, 8, 8], 0..16
    labels = torch.tensor(bunch.target, dtype=torch.int64)
    n = len(labels)
    order = sorted(range(n), key=lambda i: stable_unit(f"digits:{i}"))
    n_val = max(1, round(n * val_fraction))
    val_mask = torch.zeros(n, dtype=torch.bool)
    val_mask[order[:n_val]] = True
    if image_size != raw.shape[-1]:
        raw = F.interpolate(
            raw, size=(image_size, image_size), mode="bilinear", align_corners=False
        )
    # One mean/std over all training pixels; the held-out images use the same ones so that
    # nothing about them leaks into preprocessing.
    train = raw[~val_mask]
    mean, std = train.mean(), train.std()
    mask = val_mask if split == "val" else ~val_mask
    images = ((raw[mask] - mean) / std).contiguous()
    return images, labels[mask].contiguous(), torch.arange(n)[mask]
