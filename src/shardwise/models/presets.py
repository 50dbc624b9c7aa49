"""Model shapes: the `ModelSpec` dataclass and the named sizes users pick with `model.name`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from shardwise.errors import ConfigError

Arch = Literal[
    "decoder", "gpt2", "moe", "resnet18", "resnet50", "hf-llama", "hf-gpt2", "custom", "hf"
]
ARCHS: tuple[str, ...] = get_args(Arch)
TRANSFORMER_ARCHS = ("decoder", "gpt2")
HF_ARCHS = ("hf-llama", "hf-gpt2")  # Hugging Face transformers models (models/hf.py)
RESNET_ARCHS = ("resnet18", "resnet50")


def llama_ffn_dim(dim: int, multiple_of: int = 256) -> int:
    """SwiGLU hidden size used by Llama: 2/3 of 4*dim, rounded up to `multiple_of`.

    Three SwiGLU matrices of 2/3*4d hold as many parameters as two GELU matrices of 4d
    (Shazeer 2020, "GLU Variants Improve Transformer", §2).
    """
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a model. Zero `n_kv_heads`/`ffn_dim` are filled in (MHA; 4*dim or Llama rule)."""

    arch: Arch  # "decoder" (Llama-style) | "gpt2" | "resnet18" | "resnet50"
    n_layers: int = 0
    dim: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0  # < n_heads: grouped-query attention (Ainslie et al. 2023)
    ffn_dim: int = 0
    vocab_size: int = 0
    max_seq_len: int = 2048  # gpt2: size of the learned position table; decoder: data default
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # RoPE base (Su et al. 2021, eq. 15)
    dropout: float = 0.0  # embedding and residual-branch dropout (layout-free masks)
    attn_dropout: float = 0.0  # attention-probability dropout (explicit softmax when > 0)
    num_classes: int = 10  # resnet only
    cifar_stem: bool = True  # resnet only: 3x3/1 stem and no max-pool, for 32x32 images
    in_channels: int = 1  # resnet only
    factory: str = ""  # custom only: `module:factory` or `file.py:factory` (models/custom.py)
    source: str = ""  # hf only: the checkpoint folder transformers builds it from (auto.py)
    task: str = "causal_lm"  # hf only: causal_lm | classification
    labels: tuple[str, ...] = ()  # hf classification: the label names, in id order
    # moe only (models/moe.py): routed SwiGLU experts of ffn_dim each in every moe_every-th block
    n_experts: int = 0
    top_k: int = 2  # experts per token (token choice)
    n_shared_experts: int = 0  # always-on experts of ffn_dim each (DeepSeekMoE)
    moe_every: int = 1  # every k-th block is MoE (1: all)
    router: Literal["softmax", "sigmoid"] = "softmax"
    capacity_factor: float = 0.0  # 0: dropless; > 0: slots per expert and sequence (moe.py)
    # channels per attention head where they are not dim / n_heads (model.head_dim; Qwen3's
    # 32 heads of 128 on a 2048-wide model); 0: dim / n_heads. Kept apart from `head_dim` so a
    # `dataclasses.replace` of dim or n_heads re-derives the width of a spec that set none
    head_dim_override: int = 0
    # hf only: an RMSNorm over each head's q and k (Qwen3's q_norm/k_norm, head_dim wide), kept
    # whole on every tp rank, which norms only its own heads: gradients summed over tp
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"model arch {self.arch!r} is unknown. Fix: one of {list(ARCHS)}.")
        if self.arch in RESNET_ARCHS:
            _require_positive(self, ("num_classes", "in_channels"))
            return
        if self.arch == "hf":  # transformers' own class for the checkpoint (models/hf/auto.py)
            return
        if self.arch == "custom":  # the user's module: its shapes are its own
            _require_positive(self, ("vocab_size", "max_seq_len"))
            return
        _require_positive(self, ("n_layers", "dim", "n_heads", "vocab_size", "max_seq_len"))
        # Fill defaults so that every consumer (memory model, TP plan) reads concrete numbers.
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.ffn_dim == 0:
            ffn = 4 * self.dim if self.arch in ("gpt2", "hf-gpt2") else llama_ffn_dim(self.dim)
            object.__setattr__(self, "ffn_dim", ffn)
        _require_positive(self, ("n_kv_heads", "ffn_dim"))
        if self.arch == "moe":
            _check_moe(self)
        _check_head_dim(self)
        if self.dim % self.n_heads and not self.head_dim_override:
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}. "
                "Fix: pick n_heads dividing dim, or set the head width (--model.head_dim)."
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by "
                f"model.n_kv_heads={self.n_kv_heads}. Fix: n_kv_heads must divide n_heads."
            )
        if self.arch in ("decoder", "moe", "hf-llama") and self.head_dim % 2:
            raise ConfigError(
                f"head dim {self._head_dim_text()} is odd; RoPE rotates pairs of channels. "
                "Fix: an even head width (dim and n_heads with an even ratio, or an even "
                "--model.head_dim)."
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head: model.head_dim where given, else dim / n_heads."""
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output: n_heads · head_dim (dim unless
        model.head_dim sets a width of its own)."""
        return self.n_heads * self.head_dim if self.n_heads else self.dim

    def _head_dim_text(self) -> str:
        if self.head_dim_override:
            return f"model.head_dim={self.head_dim_override}"
        return f"dim/n_heads={self.dim}/{self.n_heads}={self.head_dim}"

    @property
    def is_transformer(self) -> bool:
        """True for the token models ("decoder", "gpt2")."""
        return self.arch in TRANSFORMER_ARCHS


def own_head_dim(width: int, heads: int, hidden: int) -> int:
    """A Hugging Face config's `head_dim` where it is a width of its own (head_dim · heads is
    not hidden_size: Mistral-Nemo, Qwen3, Gemma), as `head_dim_override`; 0 (derived) else."""
    return width if width and heads and width * heads != hidden else 0


def _require_positive(spec: ModelSpec, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(spec, name)
        if value <= 0:
            raise ConfigError(
                f"model.{name}={value} must be > 0 for arch {spec.arch!r}. Fix: set it positive."
            )


def _check_head_dim(spec: ModelSpec) -> None:
    """A head width of its own: positive, and only where q/k/v are projections of their own
    (the Llama-style decoders; GPT-2's fused c_attn and its export have no head_dim)."""
    if spec.head_dim_override < 0:
        raise ConfigError(
            f"model.head_dim={spec.head_dim_override} must be >= 0. Fix: e.g. 128, or 0 for "
            "dim / n_heads."
        )
    if spec.head_dim_override and spec.arch not in ("decoder", "moe", "hf-llama", "hf"):
        raise ConfigError(
            f"model.head_dim={spec.head_dim_override} applies to the Llama-style decoders "
            f"(decoder, moe), and this model is arch {spec.arch!r}, whose heads are dim / "
            "n_heads wide. Fix: --model.head_dim=0, or a Llama-style preset (tiny, 125m, ...)."
        )


def _check_moe(spec: ModelSpec) -> None:
    _require_positive(spec, ("n_experts", "top_k", "moe_every"))
    bad = ""
    if spec.top_k > spec.n_experts:
        bad = (
            f"model.top_k={spec.top_k} > model.n_experts={spec.n_experts}. Fix: top_k <= n_experts."
        )
    elif spec.moe_every > spec.n_layers:
        bad = (
            f"model.moe_every={spec.moe_every} > model.n_layers={spec.n_layers}: no block would "
            f"be MoE. Fix: moe_every <= {spec.n_layers} (1: every block)."
        )
    elif spec.n_shared_experts < 0:
        bad = (
            f"model.n_shared_experts={spec.n_shared_experts} must be >= 0. Fix: e.g. 1, or 0 "
            "for none."
        )
    elif spec.capacity_factor < 0:
        bad = (
            f"model.capacity_factor={spec.capacity_factor} must be >= 0. Fix: e.g. 1.25, or 0 "
            "for dropless routing."
        )
    elif spec.router not in ("softmax", "sigmoid"):
        bad = f"model.router={spec.router!r} is unknown. Fix: softmax or sigmoid."
    if bad:
        raise ConfigError(bad)


def _decoder(
    n_layers: int, dim: int, n_heads: int, n_kv: int, ffn: int, vocab: int, max_seq_len: int = 2048
) -> ModelSpec:
    return ModelSpec("decoder", n_layers, dim, n_heads, n_kv, ffn, vocab, max_seq_len)


def _gpt2(n_layers: int, dim: int, n_heads: int, vocab: int, seq: int) -> ModelSpec:
    return ModelSpec(
        "gpt2", n_layers, dim, n_heads, n_heads, 4 * dim, vocab, seq, tie_embeddings=True
    )


PRESETS: dict[str, ModelSpec] = {
    "tiny": _decoder(4, 128, 4, 2, 352, 4096, max_seq_len=512),
    "125m": _decoder(12, 768, 12, 12, 2048, 32000),
    # 1.3B class (the GPT-3 "XL" depth/width) with a Llama-style block.
    "1b": _decoder(24, 2048, 16, 16, 5504, 32000),
    # Llama 2 (Touvron et al. 2023, Table 1 / released configs).
    "7b": _decoder(32, 4096, 32, 32, 11008, 32000, max_seq_len=4096),
    "13b": _decoder(40, 5120, 40, 40, 13824, 32000, max_seq_len=4096),
    "70b": _decoder(80, 8192, 64, 8, 28672, 32000, max_seq_len=4096),
    # GPT-3 175B depth/width/heads (Brown et al. 2020, Table 2.1). GPT-3's MLP is 2 matrices
    # of 4d = 49152; a SwiGLU block has 3 matrices, so it uses 2/3 * 4d = 32768 to keep the
    # 175B parameter count (Shazeer 2020). 49152 with SwiGLU would be 233B.
    "175b": _decoder(96, 12288, 96, 96, 32768, 50304),
    # tiny with its MLPs as 4 experts (top-2) of half its width: as many active parameters
    "moe-tiny": ModelSpec("moe", 4, 128, 4, 2, 176, 4096, 512, n_experts=4, top_k=2),
    # benchmark shape: 16 experts top-2 + 1 shared expert of 1024 in 16 blocks of 1024;
    # counted (models.count_params, moe.inactive_params): 988.6M total, 283.9M active
    "moe-1b": ModelSpec(
        "moe", 16, 1024, 16, 16, 1024, 32000, n_experts=16, top_k=2, n_shared_experts=1
    ),
    "gpt2-tiny": _gpt2(4, 128, 4, 4096, 512),
    # GPT-2 small (Radford et al. 2019) with the vocabulary padded to a multiple of 64.
    "gpt2-125m": _gpt2(12, 768, 12, 50304, 1024),
    # The same tiny shapes as Hugging Face models built from transformers configs.
    "hf-llama-tiny": ModelSpec("hf-llama", 4, 128, 4, 2, 352, 4096, 512),
    "hf-gpt2-tiny": ModelSpec("hf-gpt2", 4, 128, 4, 4, 512, 4096, 512, tie_embeddings=True),
    "resnet18": ModelSpec("resnet18"),
    "resnet50": ModelSpec("resnet50"),
}


class UnknownPresetError(ConfigError, KeyError):
    """A preset name that is not in `PRESETS` (a `KeyError` and a `ConfigError`)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def preset(name: str, **overrides: object) -> ModelSpec:
    """The named `ModelSpec`, with optional field overrides (validated again)."""
    if name not in PRESETS:
        raise UnknownPresetError(
            f"unknown model preset {name!r}. Fix: one of the known presets {list(PRESETS)}."
        )
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(
            f"unknown model field(s) {unknown}. Fix: use the fields {sorted(fields)}."
        )
    spec = PRESETS[name]
    return dataclasses.replace(spec, **overrides) if overrides else spec  # type: ignore[arg-type]


def preset_of_arch(spec: ModelSpec) -> str:
    """The name of a preset of `spec`'s architecture (the first in PRESETS): what
    `model.name` needs when the shape comes from model.* keys (e.g. a DCP, which holds no
    config)."""
    return next(n for n, s in PRESETS.items() if s.arch == spec.arch)
