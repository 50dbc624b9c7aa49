"""Hugging Face `transformers` models built locally from a config (no downloads), trained
through their own module names: `LlamaForCausalLM` ("hf-llama") and `GPT2LMHeadModel`
("hf-gpt2"). They return an output object whose `.logits` the loss reads.

`transformers` is an optional dependency (the `dev` extra); it is imported on first use.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.hf.auto import import_transformers
from shardwise.models.packing import take_packed_tokens
from shardwise.models.presets import ModelSpec


def build_hf(spec: ModelSpec) -> nn.Module:
    """The Hugging Face model for `spec` on the current default device (meta is fine)."""
    tf = import_transformers()
    config = _config(spec)
    cls = tf.LlamaForCausalLM if spec.arch == "hf-llama" else tf.GPT2LMHeadModel
    model = cls(config)
    model.spec = spec  # read by init (find_spec) like our own models'
    take_packed_tokens(model)  # data.pack=true: records packed in rows
    model.shardwise_buffers = _rope_buffers(model)
    return model


def export_config(spec: ModelSpec, dtype: str) -> dict:
    """config.json of a trained hf-* preset (`shardwise export --format hf`): the very config
    it was built and trained with, so transformers' `from_pretrained` rebuilds that model; the
    weights keep transformers' own names (weights.rule_for)."""
    config = _config(spec)
    config.use_cache = True  # off while training (no generation); generation wants it
    config.architectures = [
        "LlamaForCausalLM" if spec.arch == "hf-llama" else "GPT2LMHeadModel",
    ]
    out = config.to_dict()
    out["dtype"] = dtype
    return out


def _config(spec: ModelSpec):
    """The transformers config of the hf-* preset `spec`."""
    tf = import_transformers()
    if spec.arch == "hf-llama":
        return tf.LlamaConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.dim,
            intermediate_size=spec.ffn_dim,
            num_hidden_layers=spec.n_layers,
            num_attention_heads=spec.n_heads,
            num_key_value_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_seq_len,
            rms_norm_eps=spec.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
            tie_word_embeddings=spec.tie_embeddings,
            use_cache=False,
            attn_implementation="sdpa",
        )
    # dropout off: GPT-2 draws it from torch's global generator, so its masks would depend
    # on the layout (model.dropout is the decoders' layout-free dropout, models/dropout.py)
    return tf.GPT2Config(
        vocab_size=spec.vocab_size,
        n_positions=spec.max_seq_len,
        n_embd=spec.dim,
        n_layer=spec.n_layers,
        n_head=spec.n_heads,
        n_inner=spec.ffn_dim,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=spec.norm_eps,
        tie_word_embeddings=spec.tie_embeddings,
        use_cache=False,
        attn_implementation="sdpa",
        bos_token_id=None,  # GPT-2's 50256 is outside a smaller vocabulary
        eos_token_id=None,
    )


def _rope_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """RoPE frequency tables are non-persistent buffers computed at construction, so a model
    built on meta has none; compute them on the CPU from the module's config to restore
    after materialisation (`init.restore_buffers`)."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            for leaf, buf in fresh.named_buffers(recurse=False):
                out[f"{name}.{leaf}"] = buf.detach().clone()
    return out
