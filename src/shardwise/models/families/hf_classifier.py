"""A Hugging Face encoder checkpoint with a new sequence-classification head."""

from __future__ import annotations

from shardwise.models.families.base import Family
from shardwise.models.families.hf_causal import build_checkpoint_model

HF_CLASSIFIER = Family(
    name="hf",
    kind="a Hugging Face model",
    archs=("hf",),
    task="classification",
    build=build_checkpoint_model,
    data="any",
    sized=False,
    classifier=True,
    from_checkpoint=True,
    tensor_parallel="checkpoint",
    recompute="checkpoint_blocks",
)
