"""`plan --model config.json` for a Hugging Face family whose blocks are not ours: the planner
reads its real modules instead of a formula.

The model is built from the config on the meta device (transformers' own class, no weights),
adapted as `train` would (LoRA, a quantised base, frozen parameters); its ZeRO units give the
model states of every layout exactly, as they do for `explain`. Activations come from fake
forwards (the engine's saved-tensor meter, plan/predict.py) at one and two samples per
micro-batch, per recomputation mode: a transformer's saved bytes are an intercept plus a
slope in the micro-batch (every tensor is per sample, or a constant such as the rotary
tables), so the two points give every micro-batch size. The matmul FLOPs count the real
non-embedding parameters. Tensor and pipeline parallelism are searched for the families
the formula models (Llama-family, GPT-2) only: for these, the search keeps tp = pp = 1.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from shardwise.errors import ConfigError
from shardwise.models.presets import ModelSpec
from shardwise.plan.layout import Job

# model types whose blocks are our decoders' (plan/shapes.py prices them by formula)
FORMULA_TYPES = ("llama", "mistral", "qwen2", "gpt2")


def real_spec(path: Path, cfg: dict) -> ModelSpec:
    """The spec of a config.json the formula does not cover: its sizes, read by transformers."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"model config '{path}' is a '{cfg.get('model_type')}' model, which the planner "
            "builds with transformers (not installed). Fix: pip install transformers."
        ) from None
    try:
        config = transformers.AutoConfig.for_model(**cfg)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"model config '{path}': transformers cannot build model_type "
            f"'{cfg.get('model_type')}' ({exc}). Fix: a config.json transformers knows."
        ) from None
    text = getattr(config, "text_config", None) or config
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    return ModelSpec(
        "hf",
        n_layers=int(getattr(text, "num_hidden_layers", 0) or 0),
        dim=int(getattr(text, "hidden_size", 0) or 0),
        n_heads=heads,
        n_kv_heads=int(getattr(text, "num_key_value_heads", 0) or heads),
        ffn_dim=int(getattr(text, "intermediate_size", 0) or getattr(text, "ffn_dim", 0) or 0),
        vocab_size=int(getattr(text, "vocab_size", 0) or 0),
        max_seq_len=int(getattr(text, "max_position_embeddings", 0) or 2048),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        source=str(path.parent),
    )


def real_job(job: Job, cfg) -> Job:
    """`job` with the real model's units, module buffers, matmul parameters and activation
    lines (intercept, slope per sample) per recomputation mode."""
    from shardwise.plan.predict import measure_activations, real_model

    units, buffers, matmul = real_model(cfg, job.spec)
    lines = []
    for mode in ("none", "selective", "full"):
        try:
            one, two = (measure_activations(cfg, job.spec, mode, b) for b in (1, 2))
        except ConfigError:  # a mode this family does not have (selective: ours only)
            continue
        lines.append((mode, (2 * one - two, two - one)))
    return dataclasses.replace(
        job,
        frozen=tuple(units),
        buffer_bytes=buffers,
        matmul_params=matmul,
        act_lines=tuple(lines),
    )


def is_real(job: Job) -> bool:
    return bool(job.act_lines)
