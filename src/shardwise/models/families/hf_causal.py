"""Any Hugging Face causal LM checkpoint, as transformers' own class (models/hf/auto.py)."""

from __future__ import annotations

import re

import torch
from torch import nn

from shardwise.models.families.base import Family
from shardwise.models.presets import ModelSpec


def build_checkpoint_model(spec: ModelSpec) -> nn.Module:
    """transformers' class for the checkpoint folder `spec.source`."""
    from shardwise.models.hf.auto import build_auto  # imports transformers on first use

    return build_auto(spec)


def _export_buffers(spec: ModelSpec, buffers: dict, dtype: str) -> dict:
    """The class's persistent buffers (a routing bias) from the run's, for the export, each in
    the dtype the run kept it in (`dtype`, the weights', does not apply to them)."""
    from shardwise.models.hf.buffers import export_buffers

    with torch.device("meta"):
        model = build_checkpoint_model(spec)
    return export_buffers(spec, model, buffers)


# transformers' Llama, Mistral, Qwen2 and Qwen3 decoder layers: attention's q/k/v/o and the MLP's
# gate/up/down projections (peft's LoRA keeps the frozen one as `.base_layer`); embeddings,
# lm_head and the norms keep the compute dtype
_BLOCK_LINEAR = re.compile(
    r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)(\.base_layer)?$"
)


def hf_block_linear(name: str) -> bool:
    """A projection inside a Llama-style decoder layer (model.layers.N.self_attn.q_proj ...)."""
    return _BLOCK_LINEAR.search(name) is not None


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
    # tp + sp: the dense classes split by their published plan (tests/test_hf_sp.py); the MoE
    # classes' attention by it, the router and experts whole on every tp rank
    # (tests/test_hf_moe_parallel.py)
    sp_model_types=("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"),
    pipeline="checkpoint",
    recompute="checkpoint_blocks",
    zero_units="blocks",  # at its repeated block class (`_no_split_modules`)
    # Llama-style attention: RoPE from position_ids, attention through transformers' registry
    # with the plain 1/sqrt(D) scale (parallel/context_hf.py)
    context_parallel=True,
    cp_model_types=("llama", "mistral", "qwen2", "qwen3"),
    # cp x tp and cp x pp: its stages rotate by the global positions (parallel/pipeline_hf.py;
    # tests/test_context_parallel_hf.py)
    cp_composes=True,
    # a checkpoint with stacked experts (models/hf/experts.py) takes the expert exchange;
    # whether it has experts is its config's answer (parallel/expert.py)
    expert_parallel=True,
    # precision.fp8: the decoder layers' projections of the model types tested against bf16
    # and one process (tests/test_fp8_hf.py); tp's per-slice scales are not checked here
    fp8_linear=hf_block_linear,
    fp8_model_types=("llama", "mistral", "qwen2", "qwen3"),
    # `export --format hf` writes its persistent buffers (GLM-4-MoE's routing biases) back
    # from the run's checkpoint, as the intake read them (models/hf/buffers.py); one the
    # checkpoint lacks is refused there, before the export writes any file
    hf_extra=_export_buffers,
)
