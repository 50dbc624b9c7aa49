"""transformers' GPT-2 (`GPT2LMHeadModel`) and our `gpt2` decoder, both directions: the
parameter map, the spec read from a checkpoint's config.json and the config.json an export
writes.

`Conv1D` stores weights as (in, out), the transpose of `nn.Linear`; q, k and v are fused in
`c_attn` (in, 3·dim), ours are three (dim, dim) projections, so wq/wk/wv are the three column
blocks of c_attn, transposed (biases: the three thirds of c_attn.bias).
"""

from __future__ import annotations

from pathlib import Path

from shardwise.models.hf.rule import Rule, unsupported

_L = r"blocks\.(\d+)\."
_H = "transformer.h.{0}."
RULES = (
    Rule(r"embed\.weight", "transformer.wte.weight"),
    Rule(r"pos_embed\.weight", "transformer.wpe.weight"),
    Rule(_L + r"attn_norm\.(weight|bias)", _H + "ln_1.{1}"),
    *(
        Rule(_L + rf"attn\.w{x}\.weight", _H + "attn.c_attn.weight", True, i, 3)
        for i, x in enumerate("qkv")
    ),
    *(
        Rule(_L + rf"attn\.w{x}\.bias", _H + "attn.c_attn.bias", False, i, 3)
        for i, x in enumerate("qkv")
    ),
    Rule(_L + r"attn\.wo\.weight", _H + "attn.c_proj.weight", True),
    Rule(_L + r"attn\.wo\.bias", _H + "attn.c_proj.bias"),
    Rule(_L + r"mlp_norm\.(weight|bias)", _H + "ln_2.{1}"),
    Rule(_L + r"mlp\.w1\.weight", _H + "mlp.c_fc.weight", True),
    Rule(_L + r"mlp\.w1\.bias", _H + "mlp.c_fc.bias"),
    Rule(_L + r"mlp\.w2\.weight", _H + "mlp.c_proj.weight", True),
    Rule(_L + r"mlp\.w2\.bias", _H + "mlp.c_proj.bias"),
    Rule(r"norm\.(weight|bias)", "transformer.ln_f.{0}"),
    Rule(r"head\.weight", "lm_head.weight"),
)


def fields(cfg: dict, path: str | Path) -> dict:
    """ModelSpec fields of the GPT-2 checkpoint whose config.json is `cfg`."""
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):  # ours is the tanh approximation
        raise unsupported(path, f"activation_function={act!r}")
    if cfg.get("scale_attn_by_inverse_layer_idx") or not cfg.get("scale_attn_weights", True):
        raise unsupported(path, "a non-standard attention scale")
    return {
        "arch": "gpt2",
        "n_layers": cfg["n_layer"],
        "dim": cfg["n_embd"],
        "n_heads": cfg["n_head"],
        "n_kv_heads": cfg["n_head"],
        "ffn_dim": cfg.get("n_inner") or 4 * cfg["n_embd"],
        "vocab_size": cfg["vocab_size"],
        "max_seq_len": cfg["n_positions"],
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
    }


def config(spec, dtype: str) -> dict:
    """config.json of our gpt2 decoder for transformers: a field for each of our dropout rates
    (embedding, residual, attention probabilities)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": spec.dim,
        "n_inner": spec.ffn_dim,
        "n_layer": spec.n_layers,
        "n_head": spec.n_heads,
        "n_positions": spec.max_seq_len,
        "vocab_size": spec.vocab_size,
        "layer_norm_epsilon": spec.norm_eps,
        "activation_function": "gelu_new",
        "resid_pdrop": spec.dropout,
        "embd_pdrop": spec.dropout,
        "attn_pdrop": spec.attn_dropout,
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": None,  # GPT-2's 50256 lies outside a smaller vocabulary
        "eos_token_id": None,
        "torch_dtype": dtype,
    }
