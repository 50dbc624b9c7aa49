"""Your own nn.Module from a `module:factory` entry point (models/custom.py)."""

from __future__ import annotations

from torch import nn

from shardwise.models.families.base import Family
from shardwise.models.presets import ModelSpec


def _build(spec: ModelSpec) -> nn.Module:
    from shardwise.models.custom import build_custom

    return build_custom(spec)


CUSTOM = Family(
    name="custom",
    kind="your own module",
    archs=("custom",),
    build=_build,
    data="any",
    sized=False,
    gemms=False,
    flops_per_token=False,
    tensor_parallel="none",
    tp_refusal="parallel.tp={tp}: tensor parallelism needs a plan of which layers to split, "
    "and model.name='{name}' has none here. Fix: --parallel.tp=1 (data parallelism and "
    "ZeRO-1/2/3 shard any module).",
    packs_rows=False,
    recompute="containers",
)
