"""Transformer decoders as plain PyTorch modules: Llama-style ("decoder") and GPT-2 ("gpt2").

Module paths are a contract: activation recomputation and tensor-parallel plans match on
names such as ``blocks.3.attn.wq`` or ``blocks.3.mlp.act``, and parameter init is keyed by
the fully-qualified parameter name. Nothing here knows about ranks.

Tensor-parallel friendliness: heads are inferred from the projected width
(``view(B, S, -1, head_dim)``), so column-sharded ``wq/wk/wv`` and row-sharded ``wo`` work
unchanged. Pipeline friendliness: a stage may set ``embed`` (and ``pos_embed``) to None to
take hidden states, set ``norm``/``head`` to None to return hidden states, and may replace
``blocks`` by an ``nn.ModuleDict`` keyed by the original indices so parameter names (and so
their init) stay those of the full model (as torchtitan does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.chunked_loss import LMHead
from shardwise.models.dropout import LayoutFreeDropout, name_sites
from shardwise.models.packing import Packed, is_packed, unpack
from shardwise.models.presets import ModelSpec


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 and cast back to the input dtype.

    Reducing the mean square in bf16/fp16 loses precision over thousands of channels, so the
    whole normalisation runs in float32 (as in the Llama reference code).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return y.to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with bias (Ba et al. 2016), computed in float32 like `RMSNorm`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight.float(), self.bias.float()
        return F.layer_norm(x.float(), (x.shape[-1],), w, b, self.eps).to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables [S, head_dim] (positions [S]; [B, S, head_dim] for [B, S]) for
    RoPE (Su et al. 2021, "RoFormer", eq. 34).

    Computed from `positions` on their device at every call, never stored at construction,
    so a model built on meta and materialised with `to_empty` needs no buffer fix-up.
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [(B,) S, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # half-split layout, see apply_rope
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [B, S, H, D] by position (RoPE), in float32, cast back to x's dtype.

    Uses the half-split ("rotate_half", GPT-NeoX / Hugging Face Llama) pairing of channels
    (i, i + D/2), so Hugging Face Llama checkpoints load without permuting wq/wk.
    """
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads (and batch)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class AttentionCore(nn.Module):
    """Parameter-free attention: RoPE (decoder only), GQA kv repeat, causal SDPA.

    forward(q [B, S, H, D], k/v [B, S, KV, D]) -> [B, S, H, D]. A separate module so that
    selective recomputation (Korthikanti et al. 2022, §5) can target exactly this part.
    With attention dropout (training only) the softmax is explicit, so that its layout-free
    mask can be applied; SDPA's fused dropout draws from the global RNG.
    """

    def __init__(self, rope_theta: float | None, attn_dropout: float = 0.0) -> None:
        super().__init__()
        self.rope_theta = rope_theta
        self.drop = LayoutFreeDropout(attn_dropout, "heads")
        self.packed: Packed | None = None  # set by Decoder.forward for packed rows
        # set by parallel/context.py when ranks split the sequence: `positions(local_len,
        # device)` of this rank's tokens and `attend(q, k, v)` ([B, H, S, D]) over all of them
        self.context = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_heads, n_kv = q.shape[2], k.shape[2]
        if n_heads % n_kv:
            raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv} kv heads")
        packed, context = self.packed, self.context
        if self.rope_theta is not None:
            if packed is not None:  # each record from position 0 (models/packing.py)
                positions = packed.positions
            elif context is not None:  # this rank's part of the sequence, not 0..S-1
                positions = context.positions(q.shape[1], q.device)
            else:
                positions = torch.arange(q.shape[1], device=q.device)
            q, k = (
                apply_rope(q, positions, self.rope_theta),
                apply_rope(k, positions, self.rope_theta),
            )
        if n_kv != n_heads:
            # Grouped-query attention (Ainslie et al. 2023): query head h reads kv head
            # h // (H / KV), as Llama's repeat_kv. An explicit repeat rather than SDPA's
            # enable_gqa keeps every SDPA backend (flash, memory-efficient, cuDNN) eligible.
            k = k.repeat_interleave(n_heads // n_kv, dim=2)
            v = v.repeat_interleave(n_heads // n_kv, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if context is not None:  # causal over the ranks' whole sequence (per record if packed)
            return context.attend(q, k, v, packed).transpose(1, 2)
        if self.training and self.drop.p > 0:
            return self._explicit(q, k, v).transpose(1, 2)
        if packed is not None:  # causal within each record only
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=packed.mask)
            return out.transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    def _explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q kᵀ / √d + causal) with dropout, times v; q, k, v [B, H, S, D]."""
        s = q.shape[2]
        if self.packed is not None:
            causal = self.packed.mask
        else:
            causal = torch.full((s, s), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + causal  # the add saves nothing
        return self.drop(scores.softmax(-1)) @ v


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with separate q, k, v, o projections."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.arch == "gpt2"
        self.head_dim = spec.head_dim
        self.wq = nn.Linear(spec.dim, spec.n_heads * spec.head_dim, bias=bias)
        self.wk = nn.Linear(spec.dim, spec.n_kv_heads * spec.head_dim, bias=bias)
        self.wv = nn.Linear(spec.dim, spec.n_kv_heads * spec.head_dim, bias=bias)
        self.wo = nn.Linear(spec.n_heads * spec.head_dim, spec.dim, bias=bias)
        rope = spec.rope_theta if spec.arch == "decoder" else None
        self.core = AttentionCore(rope, spec.attn_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        return self.wo(self.core(q, k, v).reshape(b, s, -1))


class SwiGLUAct(nn.Module):
    """silu(a) * b (Shazeer 2020, "GLU Variants Improve Transformer"); parameter-free."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * b


class GELUAct(nn.Module):
    """tanh-approximated GELU, as in GPT-2 (Hendrycks & Gimpel 2016); parameter-free."""

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return F.gelu(a, approximate="tanh")


class MLP(nn.Module):
    """decoder: w2(silu(w1 x) * w3 x), no biases; gpt2: w2(gelu(w1 x)), with biases."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gated = spec.arch == "decoder"
        bias = not self.gated
        self.w1 = nn.Linear(spec.dim, spec.ffn_dim, bias=bias)
        if self.gated:
            self.w3 = nn.Linear(spec.dim, spec.ffn_dim, bias=False)
        self.w2 = nn.Linear(spec.ffn_dim, spec.dim, bias=bias)
        self.act: nn.Module = SwiGLUAct() if self.gated else GELUAct()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(self.act(self.w1(x), self.w3(x)))
        return self.w2(self.act(self.w1(x)))


def _norm(spec: ModelSpec) -> nn.Module:
    return (
        LayerNorm(spec.dim, spec.norm_eps)
        if spec.arch == "gpt2"
        else RMSNorm(spec.dim, spec.norm_eps)
    )


class Block(nn.Module):
    """Pre-norm residual block: x + drop(attn(attn_norm(x))), then x + drop(mlp(mlp_norm(x)))
    (the dropouts are identities unless `spec.dropout` > 0 and training)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = _norm(spec)
        self.attn = Attention(spec)
        self.mlp_norm = _norm(spec)
        self.mlp = MLP(spec)
        self.attn_drop = LayoutFreeDropout(spec.dropout, "sequence")
        self.mlp_drop = LayoutFreeDropout(spec.dropout, "sequence")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_drop(self.attn(self.attn_norm(x)))
        return x + self.mlp_drop(self.mlp(self.mlp_norm(x)))


class Decoder(nn.Module):
    """Causal language model: tokens [B, S] -> logits [B, S, vocab]; given the targets and
    `loss_chunks` > 1, the summed loss instead, the logits never whole (models/chunked_loss.py).

    Built with torch's default initialisation; call `shardwise.models.init_weights`.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if not spec.is_transformer:
            raise ValueError(f"Decoder needs arch 'decoder' or 'gpt2', got {spec.arch!r}")
        self.spec = spec
        self.embed: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.dim)
        self.pos_embed: nn.Embedding | None = None
        if spec.arch == "gpt2":  # learned absolute positions (Radford et al. 2019)
            self.pos_embed = nn.Embedding(spec.max_seq_len, spec.dim)
        self.blocks: nn.ModuleList | nn.ModuleDict = nn.ModuleList(
            Block(spec) for _ in range(spec.n_layers)
        )
        self.norm: nn.Module | None = _norm(spec)
        self.head: nn.Linear | None = LMHead(spec.dim, spec.vocab_size, bias=False)
        # every block's attention core, told each forward whether its rows are packed (the
        # transformations after this wrap forwards, never replace the cores)
        self._cores = [m for m in self.blocks.modules() if isinstance(m, AttentionCore)]
        if spec.tie_embeddings:  # one Parameter, seen once by .parameters() and optimizers
            self.head.weight = self.embed.weight
        self.embed_drop = LayoutFreeDropout(spec.dropout, "sequence")
        name_sites(self)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Decoder:
        # Moving meta -> a real device (`to_empty`) creates a new Parameter per module and
        # silently unties the head from the embedding; tie them again after any conversion.
        out = super()._apply(fn, recurse)
        if self.spec.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.weight
        return out

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, loss_chunks: int = 0
    ) -> torch.Tensor:
        """tokens [B, S], or packed records [B, 2, S] (models/packing.py), or hidden states
        [B, S, dim] when `embed` is None; with `targets`, see `output`."""
        packed = None
        if is_packed(tokens):
            tokens, packed = unpack(tokens, self.embed.weight.dtype)
        for core in self._cores:
            core.packed = packed
        h = self.embed_tokens(tokens, packed)
        blocks = self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks
        for block in blocks:
            h = block(h)
        return self.output(h, targets, loss_chunks)

    def embed_tokens(self, tokens: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
        """Token (and learned position) embeddings; hidden states pass through unchanged."""
        h = self.embed(tokens) if self.embed is not None else tokens
        if self.pos_embed is not None:
            seq_len = h.shape[1]
            if seq_len > self.spec.max_seq_len:
                raise ValueError(
                    f"sequence length {seq_len} exceeds max_seq_len={self.spec.max_seq_len} "
                    "of the learned position table; raise model.max_seq_len or shorten data"
                )
            positions = torch.arange(seq_len, device=h.device)
            h = h + self.pos_embed(packed.positions if packed is not None else positions)
        return self.embed_drop(h) if self.embed is not None else h

    def output(
        self, h: torch.Tensor, targets: torch.Tensor | None = None, loss_chunks: int = 0
    ) -> torch.Tensor:
        """Final norm and head (each skipped when a pipeline stage does not hold it). With
        `targets` [B, S], the summed cross-entropy, computed `loss_chunks` chunks of tokens
        at a time (train.loss_chunks)."""
        if self.norm is not None:
            h = self.norm(h)
        if targets is None:
            return self.head(h) if self.head is not None else h
        if not isinstance(self.head, LMHead):  # e.g. a LoRA adapter on the head
            raise ConfigError(
                f"train.loss_chunks={loss_chunks} computes the loss inside the output head, but "
                f"the head is a {type(self.head).__name__}. Fix: --train.loss_chunks=0, or "
                "leave 'head' out of finetune.lora_targets."
            )
        return self.head(h, targets, loss_chunks)
