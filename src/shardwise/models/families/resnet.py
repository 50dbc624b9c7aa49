"""ResNet-18/50 image classifiers (models/resnet.py)."""

from __future__ import annotations

from shardwise.models.families.base import Family
from shardwise.models.resnet import ResNet

RESNET = Family(
    name="resnet",
    kind="a ResNet",
    archs=("resnet18", "resnet50"),
    build=ResNet,
    data="images",
    sized=False,
    gemms=False,
    flops_per_token=False,
    tensor_parallel="none",
    tp_refusal="parallel.tp={tp}: tensor parallelism splits transformer layers, and "
    "model.name='{name}' is a ResNet. Fix: --parallel.tp=1.",
    packs_rows=False,
)
