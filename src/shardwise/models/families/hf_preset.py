"""transformers' Llama and GPT-2 classes built from our presets (models/hf/build.py)."""

from __future__ import annotations

from torch import nn

from shardwise.models.families.base import BlockShape, Family
from shardwise.models.families.hf_causal import hf_block_linear
from shardwise.models.presets import ModelSpec


def _build(spec: ModelSpec) -> nn.Module:
    from shardwise.models.hf.build import build_hf  # imports transformers on first use

    return build_hf(spec)


def _export_config(spec: ModelSpec, dtype: str) -> dict:
    from shardwise.models.hf.build import export_config

    return export_config(spec, dtype)


def _paths(block: str, *linears: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((block + path, tag) for path, tag in linears)


# `shardwise export --format hf`: the config it trained with, its dropout (none) included;
# ZeRO units at the embedding, each decoder layer, the final norm and the head, as a
# checkpoint of the same class is cut (and as the planner lists them)
_EXPORT = dict(hf_config=_export_config, hf_keeps_dropout=True, compiles=True, zero_units="blocks")

HF_LLAMA = Family(
    name="hf-llama",
    kind="a Hugging Face model",
    archs=("hf-llama",),
    build=_build,
    context_parallel=True,  # its attention through transformers' registry (context_hf.py)
    cp_composes=True,  # cp x tp (tests/test_context_parallel_hf.py)
    sp_model_types=("llama",),  # tp + sp (tests/test_hf_sp.py)
    fp8_linear=hf_block_linear,  # precision.fp8 (tests/test_fp8_hf.py)
    # gate_proj, up_proj, down_proj with RoPE and RMSNorm, as our decoder (models/hf/build.py)
    block=BlockShape(
        gated_mlp=True,
        rotary=True,
        rms_norm=True,
        norms_last=True,
        transformers=True,
        linear_paths=_paths(
            "model.layers.0.",
            ("self_attn.q_proj", "wq"),
            ("self_attn.k_proj", "wk"),
            ("self_attn.v_proj", "wv"),
            ("self_attn.o_proj", "wo"),
            ("mlp.gate_proj", "w1"),
            ("mlp.up_proj", "w3"),
            ("mlp.down_proj", "w2"),
        ),
    ),
    **_EXPORT,
)
HF_GPT2 = Family(
    name="hf-gpt2",
    kind="a Hugging Face model",
    archs=("hf-gpt2",),
    build=_build,
    grouped_query=False,
    # the planner's units and GEMMs: our GPT-2 block (LayerNorm, biases, a position table)
    # with transformers' fused q|k|v `c_attn` (one tensor in the unit)
    block=BlockShape(
        layer_norm=True,
        biases=True,
        learned_positions=True,
        fused_qkv=True,
        transformers=True,
        linear_paths=_paths(
            "transformer.h.0.",
            ("attn.c_attn", "wqkv"),
            ("attn.c_proj", "wo"),
            ("mlp.c_fc", "w1"),
            ("mlp.c_proj", "w2"),
        ),
    ),
    **_EXPORT,
)
