"""transformers' Llama (`LlamaForCausalLM`) and our `decoder`, both directions: the parameter
map, the spec read from a checkpoint's config.json, the config.json an export writes, and the
transformers model built from a spec (`model.name=hf-llama-*`).

One tensor per projection, the same (out, in) layout as ours. Our RoPE pairs channels
(i, i + D/2) ("rotate_half"), the convention of the Hugging Face Llama checkpoints (Meta's
original weights are permuted into it by transformers' conversion script), so q/k load
without a permutation.
"""

from __future__ import annotations

from pathlib import Path

from shardwise.models.hf.rule import Rule, unsupported
from shardwise.models.presets import own_head_dim

_L = r"blocks\.(\d+)\."
RULES = (
    Rule(r"embed\.weight", "model.embed_tokens.weight"),
    Rule(_L + r"attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    Rule(_L + r"attn\.wq\.weight", "model.layers.{0}.self_attn.q_proj.weight"),
    Rule(_L + r"attn\.wk\.weight", "model.layers.{0}.self_attn.k_proj.weight"),
    Rule(_L + r"attn\.wv\.weight", "model.layers.{0}.self_attn.v_proj.weight"),
    Rule(_L + r"attn\.wo\.weight", "model.layers.{0}.self_attn.o_proj.weight"),
    Rule(_L + r"mlp_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    Rule(_L + r"mlp\.w1\.weight", "model.layers.{0}.mlp.gate_proj.weight"),
    Rule(_L + r"mlp\.w3\.weight", "model.layers.{0}.mlp.up_proj.weight"),
    Rule(_L + r"mlp\.w2\.weight", "model.layers.{0}.mlp.down_proj.weight"),
    Rule(r"norm\.weight", "model.norm.weight"),
    Rule(r"head\.weight", "lm_head.weight"),
)


def fields(cfg: dict, path: str | Path) -> dict:
    """ModelSpec fields of the Llama checkpoint whose config.json is `cfg`."""
    heads = cfg["num_attention_heads"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise unsupported(path, f"hidden_act={cfg['hidden_act']!r}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise unsupported(path, "attention/MLP biases")
    own = own_head_dim(cfg.get("head_dim") or 0, heads, cfg["hidden_size"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise unsupported(path, f"RoPE scaling {rope}")
    return {
        "arch": "decoder",
        "n_layers": cfg["num_hidden_layers"],
        "dim": cfg["hidden_size"],
        "n_heads": heads,
        "n_kv_heads": cfg.get("num_key_value_heads") or heads,
        "ffn_dim": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "max_seq_len": cfg.get("max_position_embeddings", 2048),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        "head_dim_override": own,
    }


def config(spec, dtype: str) -> dict:
    """config.json of our decoder for transformers. Its Llama has attention dropout only, so
    a residual/embedding rate cannot be carried (`export_hf` says so)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.dim,
        "intermediate_size": spec.ffn_dim,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},  # 5.x
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": spec.attn_dropout,
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": dtype,
    }
