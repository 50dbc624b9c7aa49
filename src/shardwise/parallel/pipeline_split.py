"""Where the model is cut into pipeline chunks, and pruning a meta model to one rank's chunks.

A decoder is the sequence embedding → blocks 0..L-1 → norm + head + loss. It is cut into
C = p·v contiguous chunks of blocks; the embedding travels with the first chunk and the norm,
head and loss with the last. Rank r holds the chunks r, r + p, r + 2p, ... (Megatron's
interleaved placement; v = 1 is the plain pipeline). The cut is data: `parallel.pp_split`
lists the blocks per chunk, or it is balanced here by a per-layer cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.decoder import Block, Decoder
from shardwise.models.families import family_of
from shardwise.models.presets import ModelSpec


@dataclass(frozen=True)
class Chunk:
    """One model chunk: its global index and the block indices it runs."""

    index: int
    blocks: tuple[int, ...]
    first: bool  # holds the embedding: takes token ids
    last: bool  # holds norm + head: produces logits (and the loss)


def layer_costs(spec: ModelSpec, seq_len: int) -> tuple[float, list[float], float]:
    """Relative cost of (embedding, each block, norm + head): the share of the model's
    parameters plus the share of its forward FLOPs, so a cut balances both memory and time.

    FLOPs per token: 2 per matmul weight plus 4·s·d for attention's QKᵀ and AV (Kaplan et
    al. 2020, table 1); the embedding is a lookup (no FLOPs), the head a d×V matmul."""
    with torch.device("meta"):
        block = Block(spec)
    block_params = sum(p.numel() for p in block.parameters())
    embed_params = spec.vocab_size * spec.dim
    if family_of(spec).block.learned_positions:
        embed_params += spec.max_seq_len * spec.dim
    head_params = spec.vocab_size * spec.dim + 2 * spec.dim  # tied or not, the last stage holds it
    block_flops = 2 * block_params + 4 * seq_len * spec.n_heads * spec.head_dim
    head_flops = 2 * spec.dim * spec.vocab_size
    params = embed_params + spec.n_layers * block_params + head_params
    flops = spec.n_layers * block_flops + head_flops
    return (
        embed_params / params,
        [block_params / params + block_flops / flops] * spec.n_layers,
        head_params / params + head_flops / flops,
    )


def balance(costs: list[float], first: float, last: float, chunks: int) -> list[int]:
    """Blocks per chunk (each >= 1) minimising the most expensive chunk, where chunk 0 also
    pays `first` and the last chunk `last` (linear partition by dynamic programming)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the least max-cost of cutting blocks [0, i) into k chunks
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            for j in range(k - 1, i):
                cost = prefix[i] - prefix[j] + (first if k == 1 else 0.0)
                cost += last if k == chunks else 0.0
                value = max(best[k - 1][j], cost)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(chunks, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def parse_split(text: str, chunks: int, n_layers: int, pp: int, v: int) -> list[int]:
    """`parallel.pp_split` ('3,3,2': blocks per chunk) checked to cover the model exactly."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"parallel.pp_split='{text}' is not a comma-separated list of block counts. Fix: "
            f"e.g. --parallel.pp_split={','.join(['1'] * chunks)} (one entry per chunk)."
        ) from None
    layout = f"pp({pp}) * pp_virtual({v}) = {chunks} chunks"
    if len(sizes) != chunks:
        raise ConfigError(
            f"parallel.pp_split='{text}' has {len(sizes)} entries but the pipeline has "
            f"{layout}. Fix: give one block count per chunk, or --parallel.pp_split='' to "
            "balance automatically."
        )
    if min(sizes) < 1 or sum(sizes) != n_layers:
        raise ConfigError(
            f"parallel.pp_split='{text}' does not cover the model: it assigns "
            f"{sum(sizes)} blocks (each entry must be >= 1) but model.n_layers={n_layers}. "
            f"Fix: entries >= 1 summing to {n_layers}, or --parallel.pp_split='' to balance "
            "automatically."
        )
    return sizes


def plan_chunks(spec: ModelSpec, pp: int, v: int, split: str, seq_len: int) -> list[Chunk]:
    """Every chunk of the pipeline (all ranks), from `split` or balanced by `layer_costs`."""
    chunks = pp * v
    if chunks > spec.n_layers:
        raise ConfigError(
            f"parallel.pp({pp}) * parallel.pp_virtual({v}) = {chunks} pipeline chunks but the "
            f"model has only {spec.n_layers} blocks (model.n_layers): every chunk needs at "
            f"least one. Fix: --parallel.pp={max(1, spec.n_layers // v)} or fewer, or more "
            "layers."
        )
    if split:
        sizes = parse_split(split, chunks, spec.n_layers, pp, v)
    else:
        first, blocks, last = layer_costs(spec, seq_len)
        sizes = balance(blocks, first, last, chunks)
    out, start = [], 0
    for c, size in enumerate(sizes):
        out.append(Chunk(c, tuple(range(start, start + size)), c == 0, c == chunks - 1))
        start += size
    return out


def prune_to_stage(model: nn.Module, chunks: list[Chunk], rank: int, pp: int, checkpoint_spec=None):
    """Keep only what pipeline rank `rank` runs (in place, on meta: no memory involved);
    returns (its chunks, the model the engine runs: the Decoder, or a Hugging Face causal LM's
    decoder-shaped view, parallel/pipeline_hf.py).

    Blocks move into an `nn.ModuleDict` keyed by their original index, so parameter names —
    and so their (seed, name) initialisation and checkpoints — are those of the full model.
    With tied embeddings the first and the last stage each keep the shared weight (as
    `embed.weight` and `head.weight`; init maps both names to the same values).
    `checkpoint_spec`: the spec of a transformers class's model (its family's
    `from_checkpoint`), cut by its own plan; None for shardwise's decoders."""
    mine = [c for c in chunks if c.index % pp == rank]
    keep = {i for c in mine for i in c.blocks}
    if checkpoint_spec is not None:
        from shardwise.parallel.pipeline_hf import prune_hf

        first, last = any(c.first for c in mine), any(c.last for c in mine)
        return mine, prune_hf(model, checkpoint_spec, keep, first, last)
    if not isinstance(model, Decoder):
        raise ConfigError(
            f"pipeline parallelism cuts transformer blocks; {type(model).__name__} has none. "
            "Fix: --parallel.pp=1."
        )
    model.blocks = nn.ModuleDict({str(i): b for i, b in enumerate(model.blocks) if i in keep})
    if not any(c.first for c in mine):
        model.embed = None
        model.pos_embed = None
    if not any(c.last for c in mine):
        model.norm = None
        model.head = None
    return mine, model
