"""Any Hugging Face causal LM checkpoint, as transformers' own class (models/hf/auto.py)."""

from __future__ import annotations

from torch import nn

from shardwise.models.families.base import Family
from shardwise.models.presets import ModelSpec


def build_checkpoint_model(spec: ModelSpec) -> nn.Module:
    """transformers' class for the checkpoint folder `spec.source`."""
    from shardwise.models.hf.auto import build_auto  # imports transformers on first use

    return build_auto(spec)


HF_CAUSAL_LM = Family(
    name="hf",
    kind="a Hugging Face model",
    archs=("hf",),
    task="causal_lm",
    build=build_checkpoint_model,
    data="any",
    sized=False,
    from_checkpoint=True,
    tensor_parallel="checkpoint",
    pipeline="checkpoint",
    recompute="checkpoint_blocks",
    # Llama-style attention: RoPE from position_ids, attention through transformers' registry
    # with the plain 1/sqrt(D) scale (parallel/context_hf.py)
    context_parallel=True,
    cp_model_types=("llama", "mistral", "qwen2"),
    # cp x tp and cp x pp: its stages rotate by the global positions (parallel/pipeline_hf.py;
    # tests/test_context_parallel_hf.py)
    cp_composes=True,
    # a checkpoint with stacked experts (models/hf/experts.py) takes the expert exchange;
    # whether it has experts is its config's answer (parallel/expert.py)
    expert_parallel=True,
)
