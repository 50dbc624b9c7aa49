"""The model as the planner sees it: architecture numbers and its ZeRO units, without a model.

`units(spec, tp)` lists the parameter tensors of every ZeRO unit in the order the engine builds
them (parallel/zero_units.unit_roots over models/decoder.py: token embedding, learned
positions, each block, final norm, head), so model-state bytes come out exactly; a test checks
it against units taken from a real (fake-tensor) model. Tensor parallelism divides the
column-/row-parallel matrices (q/k/v/w1/w3 by output, wo/w2 by input) and the vocabulary by
tp, as in Megatron-LM (Shoeybi et al. 2019, §3).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache
from pathlib import Path

from shardwise.errors import ConfigError
from shardwise.finetune.lora import is_path_pattern, target_matches
from shardwise.models import PRESETS, ModelSpec, preset
from shardwise.models.families import family_of
from shardwise.models.moe import is_moe_block
from shardwise.models.presets import own_head_dim
from shardwise.models.spec import hf_head_dim, hf_qk_norm

Entry = tuple  # (elements, trainable) or (elements, trainable, bytes per element if not compute)


@dataclass(frozen=True)
class Unit:
    name: str
    entries: tuple[Entry, ...]
    count: int = 1  # identical units (transformer blocks)

    @property
    def numel(self) -> int:
        return sum(e[0] for e in self.entries)


def split_trainable(us: list[Unit]) -> list[Unit]:
    """Each unit's trainable and frozen entries as two units, as the engine builds them
    (parallel/zero.py: frozen parameters never share a unit with trainable ones)."""
    out = []
    for u in us:
        trainable = tuple(e for e in u.entries if e[1])
        frozen = tuple(e for e in u.entries if not e[1])
        if trainable and frozen:
            out += [Unit(u.name, trainable, u.count), Unit(f"{u.name}[frozen]", frozen, u.count)]
        else:
            out.append(u)
    return out


def _linear(fan_in: int, fan_out: int, bias: bool, name: str | tuple = "") -> list[Entry]:
    return [(fan_in * fan_out, True, name)] + ([(fan_out, True)] if bias else [])


def _norm(spec: ModelSpec) -> list[Entry]:
    return [(spec.dim, True)] * (2 if family_of(spec).block.layer_norm else 1)


def _kv_width(spec: ModelSpec, tp: int) -> int:
    """k/v projection width on one tp rank: split by kv heads when tp divides them, else the
    whole (replicated) projection, of which each rank uses its query heads' kv head and whose
    partial gradients are summed over tp (parallel/tensor.py)."""
    kv = spec.n_kv_heads * spec.head_dim
    return kv // tp if spec.n_kv_heads % tp == 0 else kv


def block_entries(spec: ModelSpec, tp: int = 1) -> list[Entry]:
    """One block's parameters in module order (attn_norm, wq, wk, wv, wo, mlp_norm, w1[, w3],
    w2; both norms last where the family registers them so; q, k and v one tensor where the
    family fuses them). Biases of row-parallel layers (wo, w2) are replicated, column-parallel
    ones split."""
    block = family_of(spec).block
    h, hd, bias = spec.dim, spec.head_dim, block.biases
    q, kv, f = spec.n_heads * hd // tp, _kv_width(spec, tp), spec.ffn_dim // tp
    if block.fused_qkv:  # one matrix and one bias (GPT-2's c_attn); tp splits each third alike
        attn = _linear(h, q + 2 * kv, bias, "wqkv")
    else:
        attn = _linear(h, q, bias, "wq") + _linear(h, kv, bias, "wk") + _linear(h, kv, bias, "wv")
    attn += [(q * h, True, "wo")] + ([(h, True)] if bias else [])
    mlp = _linear(h, f, bias, "w1")
    if block.gated_mlp:
        mlp += _linear(h, f, False, "w3")
    mlp += [(f * h, True, "w2")] + ([(h, True)] if bias else [])
    if block.norms_last:
        return attn + mlp + _norm(spec) + _norm(spec)
    return _norm(spec) + attn + _norm(spec) + mlp


def linear_shapes(spec: ModelSpec, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(fan_in, fan_out) per block linear on one tp rank: the LoRA targets (q, k and v as one
    `wqkv` where the family fuses them: peft adapts GPT-2's c_attn with one A and one B)."""
    h, hd = spec.dim, spec.head_dim
    q, kv, f = spec.n_heads * hd // tp, _kv_width(spec, tp), spec.ffn_dim // tp
    out = {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h), "w1": (h, f), "w2": (f, h)}
    if family_of(spec).block.fused_qkv:
        out = {
            "wqkv": (h, q + 2 * kv),
            **{k: v for k, v in out.items() if k not in ("wq", "wk", "wv")},
        }
    if family_of(spec).block.gated_mlp:
        out["w3"] = (h, f)
    return out


def lora_tags(spec: ModelSpec, pattern: str) -> tuple[str, ...]:
    """The block linears (`linear_shapes` names) a finetune.lora_targets pattern adapts, as
    finetune/lora.py matches it: a plain name the last part of a path, a pattern with '.' or
    a wildcard the whole path; transformers' blocks by their own paths (BlockShape.linear_paths:
    GPT-2's `c_proj` is both wo and w2), ours by the planner's names."""
    paths = family_of(spec).block.linear_paths
    leaf = pattern.rpartition(".")[2]
    if not paths:  # ours: by the planner's names (a path pattern by its last part)
        return (leaf,) if leaf in linear_shapes(spec) else ()
    wild = is_path_pattern(pattern)
    hits = (t for p, t in paths if (fnmatchcase(p, pattern) if wild else p.endswith("." + leaf)))
    return tuple(dict.fromkeys(hits))


def block_linear_paths(spec: ModelSpec, i: int) -> list[tuple[str, str]]:
    """(path, planner's name) of block `i`'s linears a finetune.lora_targets pattern can name:
    transformers' by their own paths (BlockShape.linear_paths, block 0's renumbered), ours as
    models/decoder.py and models/moe.py name them (an MoE block's router and shared experts)."""
    paths = family_of(spec).block.linear_paths
    if paths:
        prefix = paths[0][0].rsplit(".0.", 1)[0]  # "model.layers", "transformer.h"
        return [(p.replace(f"{prefix}.0.", f"{prefix}.{i}.", 1), t) for p, t in paths]
    moe = is_moe_block(spec, i)
    mlp = ["router", *(("w1", "w3", "w2") if spec.n_shared_experts else ())] if moe else []
    out = [(f"blocks.{i}.attn.{t}", t) for t in ("wq", "wk", "wv", "wo")]
    if moe:
        return out + [(f"blocks.{i}.mlp.{'' if t == 'router' else 'shared.'}{t}", t) for t in mlp]
    dense = ("w1", "w3", "w2") if family_of(spec).block.gated_mlp else ("w1", "w2")
    return out + [(f"blocks.{i}.mlp.{t}", t) for t in dense]


def layer_tags(spec: ModelSpec, patterns: list[str]) -> tuple[tuple[str, ...], ...]:
    """The planner's names of the linears `patterns` adapt in each block; () when every block
    has the same ones (then `FineTune.lora_targets` says which, for all of them)."""
    out = tuple(
        tuple(dict.fromkeys(t for p, t in block_linear_paths(spec, i) if _hit(p, patterns)))
        for i in range(spec.n_layers)
    )
    return out if len(set(out)) > 1 else ()


def _hit(path: str, patterns: list[str]) -> bool:
    return any(target_matches(path, pattern) for pattern in patterns)


def linear_names(spec: ModelSpec) -> list[str]:
    """The names of a block's linears a finetune.lora_targets pattern can give."""
    paths = family_of(spec).block.linear_paths
    return list(dict.fromkeys(p.rpartition(".")[2] for p, _ in paths)) or list(linear_shapes(spec))


@lru_cache(maxsize=4096)
def units(spec: ModelSpec, tp: int = 1, layers: int | None = None, first=True, last=True):
    """ZeRO units of a pipeline stage holding `layers` blocks (all by default) and the
    embedding (`first`) and/or the final norm and head (`last`)."""
    v = -(-spec.vocab_size // tp)  # vocabulary split, padded to a multiple of tp
    out = []
    if first:
        out.append(Unit("embed", ((v * spec.dim, True),)))
        if family_of(spec).block.learned_positions:
            out.append(Unit("pos_embed", ((spec.max_seq_len * spec.dim, True),)))
    n = spec.n_layers if layers is None else layers
    if n and spec.n_experts:  # MoE blocks beside the dense ones (plan/moe.py prices them)
        out += block_units(spec, tp, n, block_entries(dense_spec(spec), tp))
    elif n:
        out.append(Unit("blocks", tuple(block_entries(spec, tp)), n))
    if last:
        out.append(Unit("norm", tuple(_norm(spec))))
        if not (spec.tie_embeddings and first):
            out.append(Unit("head", ((v * spec.dim, True),)))
    return tuple(out)


def module_buffer_bytes(spec: ModelSpec) -> int:
    """Bytes of the model's own buffers on every rank: transformers' LlamaRotaryEmbedding keeps
    `inv_freq` and `original_inv_freq` (head_dim / 2 fp32 each, never cast to the compute
    dtype); our decoders and transformers' GPT-2 hold none."""
    block = family_of(spec).block
    return 2 * 4 * (spec.head_dim // 2) if block.transformers and block.rotary else 0


def param_count(spec: ModelSpec) -> int:
    return sum(u.numel * u.count for u in units(spec))


@lru_cache(maxsize=256)
def non_embedding_params(spec: ModelSpec) -> int:
    """Parameters that cost matmul FLOPs: all but lookup tables (a tied head still counts),
    as metrics.flops_per_token counts them."""
    total = param_count(spec)
    total -= spec.vocab_size * spec.dim if not spec.tie_embeddings else 0
    if family_of(spec).block.learned_positions:
        total -= spec.max_seq_len * spec.dim
    return total


# Hugging Face config keys -> ModelSpec fields (Llama/Mistral/Qwen2 family and GPT-2).
_HF_LLAMA = {
    "num_hidden_layers": "n_layers",
    "hidden_size": "dim",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "ffn_dim",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_seq_len",
    "tie_word_embeddings": "tie_embeddings",
}
_HF_GPT2 = {
    "n_layer": "n_layers",
    "n_embd": "dim",
    "n_head": "n_heads",
    "n_inner": "ffn_dim",
    "vocab_size": "vocab_size",
    "n_positions": "max_seq_len",
    "tie_word_embeddings": "tie_embeddings",
}
# families whose blocks are our decoder's (Qwen2 adds q/k/v biases: 0.1 % of its weights);
# any other config.json is priced from its real modules (job/real.py)
_DECODER_TYPES = ("llama", "mistral", "qwen2")


def spec_from_hf_config(path: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face `config.json`: our decoder's shape (Llama-family, GPT-2),
    or transformers' sizes of any other family (`arch="hf"`, priced from its real modules)."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"model config '{path}' does not exist. Fix: pass a config.json."
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model config '{path}' is not readable JSON ({exc}).") from None
    kind = str(cfg.get("model_type", "")).lower()
    if kind == "gpt2":  # (transformers' GPT2Config ties by default, LlamaConfig does not)
        keys, arch, tied = _HF_GPT2, "gpt2", True
    elif kind in _DECODER_TYPES:
        keys, arch, tied = _HF_LLAMA, "decoder", False
    else:  # priced from its real modules (job/real.py)
        return real_spec(p, cfg)
    fields = {field: cfg[key] for key, field in keys.items() if cfg.get(key) is not None}
    missing = {"n_layers", "dim", "n_heads", "vocab_size"} - set(fields)
    if missing:
        names = [k for k, f in keys.items() if f in missing]
        raise ConfigError(f"model config '{path}' lacks {names}. Fix: a complete config.json.")
    fields.setdefault("tie_embeddings", tied)
    # a head width of its own (Mistral-Nemo: 32 heads of 128 on 5120; GPT-2 configs have none)
    width = int(cfg.get("head_dim") or 0)
    fields["head_dim_override"] = own_head_dim(width, fields["n_heads"], fields["dim"])
    return ModelSpec(arch, **fields)  # type: ignore[arg-type]


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
        head_dim_override=hf_head_dim(text),
        qk_norm=hf_qk_norm(text),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        source=str(path.parent),
    )


def resolve_model(name: str) -> ModelSpec:
    """A named preset, or a path to a Hugging Face config.json."""
    if name.endswith(".json") or Path(name).is_file():
        return spec_from_hf_config(name)
    if name not in PRESETS:
        raise ConfigError(
            f"unknown model '{name}'. Fix: one of {', '.join(PRESETS)}, a path to a Hugging "
            "Face config.json, or --params N to plan model states only."
        )
    return preset(name)


# MoE decoders (models/moe.py): which blocks hold experts and what their units hold


def is_moe(spec: ModelSpec | None) -> bool:
    """Whether `spec` has routed experts (a spec field, not a family name)."""
    return bool(spec is not None and spec.n_experts)


def dense_spec(spec: ModelSpec) -> ModelSpec:
    """The decoder whose blocks an MoE spec's dense parts are (models/moe.MoEDecoder builds
    them from the same spec as arch 'decoder'); `spec` itself when it has no experts."""
    if not is_moe(spec):
        return spec
    return dataclasses.replace(spec, arch="decoder", n_experts=0, n_shared_experts=0)


def moe_blocks(spec: ModelSpec, layers: int | None = None) -> int:
    """MoE blocks among `layers` blocks (all by default): every moe_every-th one."""
    n = spec.n_layers if layers is None else layers
    return n // spec.moe_every if is_moe(spec) else 0


def moe_block_entries(spec: ModelSpec, tp: int, dense_block: list) -> list:
    """One MoE block's parameters in module order: the dense block's attention and norms,
    then the stacked experts (w1, w3, w2), the router and the shared experts' SwiGLU. Expert
    entries carry their 3-D shape, which `split_units` recognises. Under tp the MoE layer
    stays whole on every tp rank (experts, router and shared experts: parallel/expert.py's
    sequence shards), so only the dense parts in `dense_block` are split."""
    h, f, e = spec.dim, spec.ffn_dim, spec.n_experts
    mlp_tags = ("w1", "w3", "w2")
    keep = [x for x in dense_block if not (len(x) > 2 and x[2] in mlp_tags)]
    out = [*keep, (e * h * f, True, (e, h, f)), (e * h * f, True, (e, h, f))]
    out += [(e * f * h, True, (e, f, h)), (e * h, True, "router")]
    if spec.n_shared_experts:  # one SwiGLU n_shared times as wide, whole as the experts
        wide = spec.ffn_dim * spec.n_shared_experts
        out += [(h * wide, True, "w1"), (h * wide, True, "w3"), (wide * h, True, "w2")]
    return out


def block_units(spec: ModelSpec, tp: int, n: int, dense_block: list) -> list[Unit]:
    """The units of `n` blocks of an MoE spec (shapes.units): dense blocks and MoE blocks."""
    k = moe_blocks(spec, n)
    out = [Unit("blocks", tuple(dense_block), n - k)] if n - k else []
    if k:
        out.append(Unit("moe_blocks", tuple(moe_block_entries(spec, tp, dense_block)), k))
    return out
