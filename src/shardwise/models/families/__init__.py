"""The model-family seam: one `Family` object per family answers everything family-specific
(how to build it, what data it trains on, which parallel dimensions and recomputation it
supports, how the planner prices its blocks), so code outside `models/` asks the family and
never compares family names.

A new family is one file in this folder defining a `Family`, plus one line in `FAMILIES`."""

from __future__ import annotations

from shardwise.errors import ConfigError
from shardwise.models.families.base import BlockShape, Family
from shardwise.models.families.custom import CUSTOM
from shardwise.models.families.decoder import DECODER, GPT2
from shardwise.models.families.hf_causal import HF_CAUSAL_LM
from shardwise.models.families.hf_classifier import HF_CLASSIFIER
from shardwise.models.families.hf_preset import HF_GPT2, HF_LLAMA
from shardwise.models.families.moe import MOE
from shardwise.models.families.resnet import RESNET
from shardwise.models.presets import ModelSpec

FAMILIES: tuple[Family, ...] = (
    DECODER,
    GPT2,
    MOE,
    RESNET,
    HF_LLAMA,
    HF_GPT2,
    HF_CAUSAL_LM,
    HF_CLASSIFIER,
    CUSTOM,
)

__all__ = ["FAMILIES", "BlockShape", "Family", "classifies", "family_of"]


def family_of(spec: ModelSpec) -> Family:
    """The family that answers for `spec` (its arch, and for a checkpoint its task)."""
    for family in FAMILIES:
        if spec.arch in family.archs and family.task in (None, spec.task):
            return family
    raise ConfigError(f"no model family builds arch {spec.arch!r} with task {spec.task!r}.")


def classifies(task: str) -> bool:
    """Whether model.task `task` builds a classifier (one label per row: the data reads labels)."""
    return any(family.classifier and family.task == task for family in FAMILIES)
