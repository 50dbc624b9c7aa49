"""torchtitan's Llama 3 at the widths of a shardwise decoder, for cuda_speed.py's torchtitan rows.

torchtitan (the PyTorch team's reference trainer) is not a library with a stable model API: its
0.3.0 release builds a Llama 3 from a tree of per-module configs (`Llama3Model.Config`), so this
file builds the tree the way its own presets do (`llama3._build_llama3_layers`, a private helper
of that release: the version is checked, not guessed) at the decoder's widths: layers, width,
heads, kv heads, SwiGLU hidden width, vocabulary, RMSNorm eps and RoPE base (no frequency
scaling: ours has none), untied head, fused qkv projection as torchtitan builds it. Attention
is SDPA, as ours (0.3.0 defaults to FlexAttention, which needs compiling to be fast and block
masks; its SDPA module is swapped in per layer, the documented way to keep SDPA).

What torchtitan's trainer does on one device and this peer does too: its `init_weights`;
`apply_compile` (each transformer block compiled with `fullgraph=True`) and its loss compiled
when compile is on (its default `compile.components`: model and loss; on plain tensors its
`cross_entropy_loss` is the peer's sum of token cross-entropies over fp32 logits); its float8
converter (`Float8LinearConverter`: rowwise recipes only in 0.3.0; the head left in bf16
through `filter_fqns`, as ours and torchtitan's large presets do); autocast bf16 over fp32
parameters (its mixed precision without FSDP) and fused AdamW. Not its trainer, data loader or
config registry: the loop, data order and AdamW settings are the AMP peer's
(cuda_profile.peer), so the rows differ only in the model code, its compile and its FP8.

On the GPU machine its wheels (and the few its model code imports: spmd_types, tyro) come from
benchmarks/gpu_wheels.sh; torch's CUDA wheels bring triton, which its MoE code imports.
"""

from __future__ import annotations

import importlib.metadata

import torch
from torch import nn

VERSION = "0.3.0"  # the model-config API this file builds with


def unavailable() -> str:
    """Why the torchtitan rows cannot run here ("" when they can)."""
    try:
        found = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return f"torchtitan not installed (benchmarks/gpu_wheels.sh fetches {VERSION})"
    if found != VERSION:
        return f"torchtitan {found} installed; this script builds with {VERSION}'s model API"
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as exc:  # a module its model code imports at load
        return f"torchtitan {VERSION} does not import: {exc}"
    return ""


def model_config(spec, seq: int, fp8: str, compile_: bool):
    """torchtitan's config tree for the decoder `spec` (FP8 `fp8`: its float8 converter)."""
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        ScaledDotProductAttention,
    )
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    head_dim = spec.dim // spec.n_heads
    rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=seq, theta=spec.rope_theta)
    layers = _build_llama3_layers(
        n_layers=spec.n_layers,
        dim=spec.dim,
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        hidden_dim=spec.ffn_dim,
        rope=rope,
        attn_backend="flex",  # 0.3.0 refuses "sdpa" here; swapped below, layer by layer
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = spec.norm_eps
    cfg = Llama3Model.Config(
        dim=spec.dim,
        vocab_size=spec.vocab_size,
        layers=layers,
        tok_embeddings=Embedding.Config(
            num_embeddings=spec.vocab_size, embedding_dim=spec.dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=spec.dim, eps=spec.norm_eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=spec.dim,
            out_features=spec.vocab_size,
            param_init=_output_linear_init(spec.dim),
        ),
    )
    if fp8 == "none":
        return cfg
    from torchtitan.components.quantization import Float8LinearConverter

    converter = Float8LinearConverter.Config(
        recipe_name=fp8, filter_fqns=["lm_head"], model_compile_enabled=compile_
    ).build()
    return converter.convert(cfg)


def build(spec, seq: int, device: torch.device, compile_: bool, fp8: str) -> nn.Module:
    """torchtitan's model for `spec`, initialised by its own `init_weights`, blocks compiled by
    its `apply_compile` when `compile_`; it must hold exactly the decoder's parameter count."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.parallel_dims import ParallelDims

    with torch.device("meta"):
        model = model_config(spec, seq, fp8, compile_).build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    if compile_:
        one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        apply_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=one)
    return model.train()
