"""The tiny transformers Llama-style models that tests save as checkpoints (model.name=hf)."""

from __future__ import annotations


def tiny_llama_config(vocab_size: int, config_class=None, **overrides):
    """transformers' LlamaConfig (or `config_class`, a Llama-style class such as MistralConfig)
    in the tiny preset's shape (width 64, 2 layers, 4 heads, 2 k/v heads, SwiGLU width 176, 128
    positions); `overrides` replace or add fields."""
    import transformers

    fields = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    return (config_class or transformers.LlamaConfig)(**{**fields, **overrides})
