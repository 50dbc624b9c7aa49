"""Pipeline parallelism for a Hugging Face causal LM (`model.name=hf`): the decoder-shaped view
the pipeline engine cuts and runs.

transformers publishes each model's stages as `base_model_pp_plan`: the token embedding, the
repeated decoder layers and the final norm (the head follows on the causal LM). The engine
runs them as it runs our decoders: the first chunk embeds, each chunk runs its layers, the last
applies norm and head. What the model's own forward computes once for all layers, each layer
computes here for itself: the rotary position embeddings (from `rotary_emb`, a buffer-only
module every stage keeps) and the causal mask (none: SDPA's is_causal, as the model's forward
chooses for an unpadded batch). Pruning keeps the names (`model.layers.{i}` stays the key of
layer i), so (seed, name) init, checkpoint slices and ZeRO units are those of the whole model.

Families whose base forward does exactly that (embed -> rotary -> layers -> norm) run; one
whose forward does more between the pieces (Gemma scales the embedding, GPT-2 adds learned
positions) is refused before launch by `check_hf_pipeline`.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.errors import ConfigError

# model_type -> the family's base model runs embed -> rotary -> layers -> norm and nothing else
PIPELINE_TYPES = ("llama", "mistral", "qwen2")  # each checked against one process (tests)


def check_hf_pipeline(model_type: str, tied: bool, pp: int) -> None:
    """Before launch: can this checkpoint's model be cut into pipeline stages?"""
    if model_type not in PIPELINE_TYPES:
        raise ConfigError(
            f"parallel.pp={pp}: a '{model_type}' model's forward does more between its "
            "published pipeline stages (base_model_pp_plan) than embed -> layers -> norm, and "
            f"shardwise cuts {', '.join(PIPELINE_TYPES)} models only. Fix: --parallel.pp=1 "
            "(data, ZeRO and tensor parallelism split it)."
        )
    if tied:
        raise ConfigError(
            f"parallel.pp={pp}: this checkpoint ties its output head to the input embedding "
            "(tie_word_embeddings), which the first and last stage would each need to load "
            "and keep equal. Fix: --parallel.pp=1 for now."
        )


class _Layer(nn.Module):
    """One decoder layer as the engine calls a block: hidden states in, hidden states out."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device)[None]
        cos_sin = self.rotary(h, position_ids=positions)
        return self.layer(
            h, attention_mask=None, position_ids=positions, position_embeddings=cos_sin
        )


class HFStages:
    """What the pipeline engine reads of a model (`spec`, `embed`, `blocks`, `norm`, `head`,
    `embed_tokens`, `output`), over a pruned transformers causal LM that keeps its own names."""

    def __init__(self, model: nn.Module, spec) -> None:
        base = model.base_model
        self.spec, self.pos_embed = spec, None
        self.embed, self.norm = base.embed_tokens, base.norm
        self.head = model.get_output_embeddings()
        self.blocks = {i: _Layer(layer, base.rotary_emb) for i, layer in base.layers.items()}

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


def prune_hf(model: nn.Module, spec, keep: set[int], first: bool, last: bool) -> HFStages:
    """Keep the layers `keep` (and the embedding on the first stage, norm and head on the
    last) of a meta causal LM, in place; layers stay under `model.layers.{i}`."""
    base = model.base_model
    base.layers = nn.ModuleDict({str(i): m for i, m in enumerate(base.layers) if i in keep})
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = None
        model.lm_head = None
    return HFStages(model, spec)
