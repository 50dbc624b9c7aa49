"""The model a config names: a preset, its size overrides checked one by one, and the sizes of
a Hugging Face checkpoint it starts from. Checks that involve the layout (tensor parallelism,
sequence length) stay with the other cross-field checks (training/validate.py)."""

from __future__ import annotations

import dataclasses

from shardwise.config import Config, ModelConfig
from shardwise.data.callables import is_import_path
from shardwise.errors import ConfigError
from shardwise.models.presets import PRESETS, RESNET_ARCHS, ModelSpec, own_head_dim, preset


def spec_from_config(cfg: Config, labels: tuple[str, ...] | None = None) -> ModelSpec:
    """The preset named by model.name with the non-zero overrides applied (and, with
    model.init_from, the checkpoint's own sizes)."""
    m = cfg.model
    if m.task != "causal_lm" and m.name != "hf":
        raise ConfigError(
            f"model.task={m.task} builds transformers' class for a checkpoint, and "
            f"model.name='{m.name}' is not one. Fix: --model.name=hf --model.init_from=DIR."
        )
    if m.name == "hf":
        return _auto(cfg, labels)
    if is_import_path(m.name):
        return _custom(cfg)
    if m.name not in PRESETS:
        names = ", ".join(PRESETS)
        raise ConfigError(
            f"model.name='{m.name}' is not a known model. Fix: one of {names}; hf "
            "(transformers' own class for a checkpoint: --model.name=hf --model.init_from=DIR); "
            "or your own nn.Module as package.module:factory or file.py:factory (e.g. "
            "--model.name=mymodels.net:build)."
        )
    spec = preset(m.name)
    overrides = _size_overrides(m, spec)
    if m.tie_embeddings != "preset":
        overrides["tie_embeddings"] = m.tie_embeddings == "true"
    overrides.update(_dropouts(m, spec))
    if spec.arch.startswith("resnet") and overrides:
        raise ConfigError(
            f"model.{next(iter(overrides))} does not apply to model.name='{m.name}'"
            " (a ResNet). Fix: remove it, or use a transformer model."
        )
    _heads_and_vocab(m, spec, overrides)
    overrides.update(_moe(cfg, spec))
    spec = dataclasses.replace(spec, **overrides)
    return _with_checkpoint_sizes(spec, m) if m.init_from else spec


def _size_overrides(m: ModelConfig, spec: ModelSpec) -> dict[str, object]:
    """The preset's sizes that model.* overrides (0: keep the preset's), checked positive."""
    overrides = {
        k: getattr(m, k)
        for k in (
            "n_layers",
            "dim",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_dim",
            "vocab_size",
            "max_seq_len",
        )
        if getattr(m, k)
    }
    for key, value in overrides.items():
        if value < 0:
            raise ConfigError(
                f"model.{key}={value} must be positive. Fix: a positive value, or "
                f"--model.{key}=0 to keep the preset's."
            )
    if "dim" in overrides and "ffn_dim" not in overrides and spec.ffn_dim and spec.dim:
        # a wider preset keeps its MLP ratio (a "1.3B" GPT-2 scaled by model.dim alone would
        # keep the small MLP and come out far smaller)
        overrides["ffn_dim"] = spec.ffn_dim * overrides["dim"] // spec.dim
    return overrides


def _dropouts(m: ModelConfig, spec: ModelSpec) -> dict[str, float]:
    """model.dropout and model.attn_dropout as spec overrides, where they apply."""
    overrides = {}
    for key in ("dropout", "attn_dropout"):
        value = getattr(m, key)
        if not 0.0 <= value < 1.0:
            raise ConfigError(
                f"model.{key}={value} is not a probability in [0, 1). Fix: e.g. "
                f"--model.{key}=0.1, or 0 for none."
            )
        if value and not (spec.is_transformer or spec.arch == "moe"):
            raise ConfigError(
                f"model.{key}={value} applies to the shardwise decoders only, and "
                f"model.name='{m.name}' is not one: {_no_dropout(spec)} Fix: "
                f"--model.{key}=0, or a decoder (tiny, gpt2-tiny, ...)."
            )
        if value:
            overrides[key] = value
    return overrides


def _heads_and_vocab(m: ModelConfig, spec: ModelSpec, overrides: dict[str, object]) -> None:
    """Check and complete `overrides` in place: the kv heads a head count keeps, the
    head width's field name, a vocabulary that holds the byte-level BPE."""
    if "n_heads" in overrides and "n_kv_heads" not in overrides:
        heads, kv = overrides["n_heads"], spec.n_kv_heads
        if heads % kv:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ConfigError(
                f"model.n_heads={heads} is not divisible by the preset's "
                f"n_kv_heads={kv} ({m.name}). Fix: also set --model.n_kv_heads="
                f"<one of {divisors}>."
            )
        overrides["n_kv_heads"] = min(kv, heads)
    if "head_dim" in overrides:  # the spec's field (its `head_dim` is the width it derives)
        overrides["head_dim_override"] = overrides.pop("head_dim")
    if "vocab_size" in overrides and overrides["vocab_size"] < 257:
        raise ConfigError(
            f"model.vocab_size={overrides['vocab_size']} is below 257, the 256 "
            "bytes of the byte-level BPE plus its end-of-text token. Fix: "
            "--model.vocab_size=4096 (or 0 for the preset's)."
        )


def _with_checkpoint_sizes(spec: ModelSpec, m: ModelConfig) -> ModelSpec:
    """`spec` with the sizes of the checkpoint model.init_from names (a DCP one is checked
    against the config instead: it holds no config)."""
    if not spec.is_transformer:
        what = (
            "a ResNet"
            if spec.arch in RESNET_ARCHS
            else "transformers' class built from a config of its own, with no weights"
        )
        raise ConfigError(
            f"model.init_from loads a checkpoint into one of shardwise's decoders, and "
            f"model.name='{m.name}' is {what}. Fix: --model.name=tiny (Llama) or gpt2-tiny "
            "(GPT-2), or --model.name=hf to train transformers' own class of the checkpoint."
        )
    from shardwise.models.dcp import check_dcp, is_dcp
    from shardwise.models.hf.weights import adapt_spec

    if is_dcp(m.init_from):  # no config inside: the shape is the config's
        check_dcp(spec, m.init_from)
    else:
        spec = adapt_spec(spec, m, m.init_from)
    return spec


_MOE_OFF = {  # each MoE key's "not given" value (config.py)
    "n_experts": 0,
    "top_k": 0,
    "n_shared_experts": -1,
    "moe_every": 1,
    "router": "softmax",
    "capacity_factor": 0.0,
}


def _moe(cfg: Config, spec: ModelSpec) -> dict[str, object]:
    """The MoE keys as spec overrides: an MoE preset's experts, or a Llama-style decoder
    preset's MLPs turned into experts by model.n_experts > 0 (arch "moe", models/moe.py)."""
    m, t = cfg.model, cfg.train
    given = [k for k, off in _MOE_OFF.items() if getattr(m, k) != off]
    given += [f"train.{k}" for k in ("moe_aux_loss", "moe_bias_balance") if getattr(t, k)]
    if spec.arch != "moe" and m.n_experts <= 0:
        if given:
            key = given[0] if "." in given[0] else f"model.{given[0]}"
            raise ConfigError(
                f"{key} applies to mixture-of-experts models, and model.name='{m.name}' has "
                "none. Fix: --model.name=moe-tiny (or moe-1b), or --model.n_experts=8 on a "
                "decoder preset (tiny, 125m, ...), or remove it."
            )
        return {}
    if spec.arch not in ("decoder", "moe"):
        raise ConfigError(
            f"model.n_experts={m.n_experts} turns the MLPs of shardwise's Llama-style decoder "
            f"into experts, and model.name='{m.name}' is not one. Fix: --model.name=moe-tiny, "
            "or a decoder preset (tiny, 125m, 1b, ...)."
        )
    for key, low in (("n_experts", 0), ("top_k", 0), ("n_shared_experts", -1), ("moe_every", 1)):
        if getattr(m, key) < low:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be >= {low}. Fix: e.g. 2.")
    for key in ("moe_aux_loss", "moe_bias_balance"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 0. Fix: 0 for off.")
    if m.init_from:
        raise ConfigError(
            f"model.init_from is not built for MoE models yet (model.name='{m.name}': no "
            "checkpoint maps a dense MLP onto experts). Fix: remove model.init_from, or a "
            "dense decoder preset."
        )
    out: dict[str, object] = {"arch": "moe"}
    out.update({k: getattr(m, k) for k in ("n_experts", "top_k") if getattr(m, k) > 0})
    if m.n_shared_experts >= 0:
        out["n_shared_experts"] = m.n_shared_experts
    out.update(moe_every=m.moe_every, router=m.router, capacity_factor=m.capacity_factor)
    return out


def _no_dropout(spec: ModelSpec) -> str:
    if spec.arch in RESNET_ARCHS:
        return "a ResNet has no dropout."
    return (
        "Hugging Face models draw dropout from torch's global generator, which would make "
        "the masks depend on the layout."
    )


def _custom(cfg: Config) -> ModelSpec:
    """Your own module (models/custom.py): the factory is imported and built on meta here, so
    a path that does not import, a factory that returns no module, or a module whose
    parameters cannot be drawn layout-invariantly stops before any process starts."""
    import torch

    from shardwise.models.custom import build_custom, check_initialisable

    m = cfg.model
    keys = ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len")
    shaped = [k for k in keys if getattr(m, k)]
    if shaped or m.init_from or m.tie_embeddings != "preset" or m.dropout or m.attn_dropout:
        given = shaped or ["init_from/tie_embeddings/dropout"]
        raise ConfigError(
            f"model.{given[0]} does not apply to model.name='{m.name}' (your own module sets "
            "its own shape). Fix: remove it; a factory argument vocab_size or seq_len is "
            "filled from model.vocab_size and data.seq_len."
        )
    spec = ModelSpec(
        "custom", vocab_size=m.vocab_size or 4096, max_seq_len=cfg.data.seq_len, factory=m.name
    )
    with torch.device("meta"):
        model = build_custom(spec)
    check_initialisable(model, m.name)
    return spec


def _auto(cfg: Config, recorded: tuple[str, ...] | None = None) -> ModelSpec:
    """transformers' own class for the checkpoint in model.init_from (models/hf/auto.py): its
    config must build, its tensors fit the model, and for classification the labels are the
    data's."""
    from shardwise.models.hf.auto import check_checkpoint, read_hf_config

    _refuse_shape_keys(cfg.model)
    _refuse_moe_keys(cfg)
    config = read_hf_config(cfg.model.init_from)
    text = getattr(config, "text_config", None) or config
    labels = _hf_labels(cfg, text, recorded)
    limit = getattr(text, "max_position_embeddings", None)
    if limit and cfg.data.seq_len > limit:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds the checkpoint's max_position_embeddings="
            f"{limit}. Fix: --data.seq_len={limit} or less."
        )
    spec = _hf_spec(cfg, config, text, labels, limit)
    check_checkpoint(spec)
    return spec


def _refuse_shape_keys(m: ModelConfig) -> None:
    """Refuse model.* shape and dropout keys with model.name=hf: the checkpoint sets them."""
    shaped = ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size")
    shaped += ("max_seq_len",)
    given = [k for k in shaped if getattr(m, k)]
    if given or m.tie_embeddings != "preset" or m.dropout or m.attn_dropout:
        key = given[0] if given else "tie_embeddings/dropout"
        raise ConfigError(
            f"model.{key} does not apply to model.name=hf: the checkpoint's config.json sets "
            "the shape (and dropout is off: its masks would depend on the layout). Fix: remove it."
        )


def _refuse_moe_keys(cfg: Config) -> None:
    """Refuse the MoE keys of shardwise's own decoder with model.name=hf."""
    m = cfg.model
    moe = [f"model.{k}" for k, off in _MOE_OFF.items() if getattr(m, k) != off]
    moe += [f"train.{k}" for k in ("moe_aux_loss", "moe_bias_balance") if getattr(cfg.train, k)]
    if moe:
        raise ConfigError(
            f"{moe[0]} applies to shardwise's own MoE decoder, not to model.name=hf: a "
            "checkpoint's experts and router are its config.json's, and shardwise adds no "
            "balance loss or bias to transformers' routers (their router aux loss multiplies "
            "two means over the whole batch, so it would change with the micro-batch split). "
            "Fix: remove it (docs/moe.md, Hugging Face MoE checkpoints)."
        )


def _hf_labels(cfg: Config, text, recorded: tuple[str, ...] | None) -> tuple[str, ...]:
    """A classifier's label names: those a run recorded (export), else the data's (2 or
    more); none for a causal LM."""
    if cfg.model.task != "classification":
        return ()
    if recorded:  # the names a run recorded (export)
        return tuple(recorded)
    from shardwise.data import data_spec
    from shardwise.data.classify import label_names

    labels = label_names(data_spec(cfg, int(getattr(text, "vocab_size", 0) or 0), True))
    if len(labels) < 2:
        raise ConfigError(
            f"data.label_field='{cfg.data.label_field}' has {len(labels)} distinct label(s) "
            f"in the training rows of '{cfg.data.dataset}'. Fix: data with 2 or more labels."
        )
    return labels


def _hf_spec(cfg: Config, config, text, labels: tuple[str, ...], limit: int | None) -> ModelSpec:
    """The spec of a checkpoint's config.json (`text`: its language model's part)."""
    m = cfg.model
    return ModelSpec(
        "hf",
        n_layers=int(getattr(text, "num_hidden_layers", 0) or 0),
        dim=int(getattr(text, "hidden_size", 0) or 0),
        n_heads=int(getattr(text, "num_attention_heads", 0) or 0),
        n_kv_heads=int(
            getattr(text, "num_key_value_heads", 0) or getattr(text, "num_attention_heads", 0) or 0
        ),
        ffn_dim=int(getattr(text, "intermediate_size", 0) or 0),
        vocab_size=int(getattr(text, "vocab_size", 0) or 0),
        max_seq_len=int(limit or cfg.data.seq_len),
        head_dim_override=hf_head_dim(text),
        qk_norm=hf_qk_norm(text),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        source=m.init_from,
        task=m.task,
        labels=labels,
    )


def hf_head_dim(text) -> int:
    """A checkpoint config's head_dim where it is not hidden_size / num_attention_heads (Qwen3,
    Gemma); 0 (derived) otherwise."""
    width = int(getattr(text, "head_dim", 0) or 0)
    heads, dim = getattr(text, "num_attention_heads", 0) or 0, getattr(text, "hidden_size", 0) or 0
    return own_head_dim(width, heads, dim)


def hf_qk_norm(text) -> bool:
    """Whether a checkpoint's class norms each head's q and k with a weight its published tp
    plan keeps whole on every rank, its gradient summed over tp (Qwen3's q_norm and k_norm:
    `replicated_with_grad_allreduce`, models/tp_plans.py)."""
    plan = getattr(text, "base_model_tp_plan", None) or {}
    return any(kind == "replicated_with_grad_allreduce" for kind in plan.values())
