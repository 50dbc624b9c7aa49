"""Pipeline parallelism for a Hugging Face causal LM (`model.name=hf`): the decoder-shaped view
the pipeline engine cuts and runs.

transformers publishes each model's stages as `base_model_pp_plan`: the modules before the
repeated decoder layers (the token embedding, GPT-NeoX's embedding dropout), the layers, the
modules after them (the final norm); the head follows on the causal LM. The engine runs them as
it runs our decoders: the first chunk applies the modules before, each chunk runs its layers,
the last applies the modules after and the head. What the model's own forward computes once
for all layers, each layer computes here for itself: the rotary position embeddings (from
`rotary_emb`, a buffer-only module every stage keeps) and the causal mask (none: SDPA's
is_causal, as the model's forward chooses for an unpadded batch; a sliding window shorter
than the sequence, Mistral's or Qwen2's, gets the boolean mask transformers builds for it,
`models/hf/window.py`). Pruning keeps the names
(`model.layers.{i}` stays the key of layer i), so (seed, name) init, checkpoint slices and ZeRO
units are those of the whole model.

Families whose base forward does exactly what the plan lists, with rotary positions, run; one
whose forward does more between the pieces (Gemma scales the embedding by sqrt(hidden), which
its plan does not say; GPT-2 and OPT add learned positions and publish no plan) is refused
before launch by `check_hf_pipeline`.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.hf.experts import number_routers
from shardwise.models.hf.window import sliding_window, window_mask
from shardwise.parallel.context_hf import CONTEXT, CONTEXT_HOLDER

# model_type -> its base forward is exactly its published plan plus rotary positions; each
# checked against one process (tests/test_hf_models.py; MoE and Qwen3: pp 2 x tp 2 + sp,
# tests/test_hf_moe_parallel.py)
PIPELINE_TYPES = (
    *("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox"),
    *("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"),
)
# model_type -> its stages under tp + sp checked against one process (each stage's layers
# number the whole sequence, `_Layer`; Mistral's attend within a sliding window shorter than
# the sequence): tests/test_hf_moe_parallel.py. Every class the checkpoint family runs under
# tp + sp; one added there stays refused over stages until it is checked and listed here
SP_PIPELINE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")

# OLMoE publishes no base_model_pp_plan, yet its base forward is Llama's (embedding, rotary
# positions, the layers, the final norm): the plan Llama publishes describes it
_UNPUBLISHED = {"olmoe": "llama"}


def check_hf_pipeline(model_type: str, tied: bool, pp: int) -> None:
    """Before launch: can this checkpoint's model be cut into pipeline stages?"""
    if model_type not in PIPELINE_TYPES:
        raise ConfigError(
            f"parallel.pp={pp}: a '{model_type}' model's forward does more between its "
            "pipeline stages than its base_model_pp_plan lists (or it publishes none), and "
            f"shardwise cuts {', '.join(PIPELINE_TYPES)} models. Fix: --parallel.pp=1 "
            "(data, ZeRO and tensor parallelism split it)."
        )
    if tied:
        raise ConfigError(
            f"parallel.pp={pp}: this checkpoint ties its output head to the input embedding "
            "(tie_word_embeddings), which the first and last stage would each need to load "
            "and keep equal. Fix: --parallel.pp=1 for now."
        )


def _plan(base: nn.Module) -> tuple[list[str], str, list[str]]:
    """(modules before the layers, the layers' name, modules after) of the published plan."""
    plan = base.config.base_model_pp_plan
    if not plan and base.config.model_type in _UNPUBLISHED:
        from transformers import CONFIG_MAPPING

        plan = CONFIG_MAPPING[_UNPUBLISHED[base.config.model_type]].base_model_pp_plan
    names = list(plan)
    layers = next(n for n, (inputs, _) in plan.items() if "attention_mask" in inputs)
    i = names.index(layers)
    return names[:i], layers, names[i + 1 :]


class _Layer(nn.Module):
    """One decoder layer as the engine calls a block: hidden states in, hidden states out."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, window: int | None) -> None:
        super().__init__()
        self.layer, self.rotary, self.window = layer, rotary, window
        # the attention module cp hands its context (parallel/context_hf.py), set after pruning
        self.attention = next((m for m in layer.modules() if hasattr(m, CONTEXT_HOLDER)), None)
        # tp ranks sharing each sequence under sp (HFStages.shard_sequence); 1 otherwise
        self.sequence_shards = 1

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # under cp a stage holds this rank's zig-zag part of each sequence: RoPE rotates each
        # token by its global position, the one the model's pre-hook passes in one stage
        context = getattr(self.attention, CONTEXT, None)
        if context is not None:
            positions = context.positions(h.shape[1], h.device)[None]
        else:  # under sp `h` holds s/tp tokens while the attention gathers all s: number s
            positions = torch.arange(h.shape[1] * self.sequence_shards, device=h.device)[None]
        cos_sin = self.rotary(h, position_ids=positions)
        mask = None
        if context is None:  # (under cp the attention masks each block itself)
            mask = window_mask(positions.shape[1], self.window, h.device)
        out = self.layer(
            h, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin
        )
        return out[0] if isinstance(out, tuple) else out


class _Sequence(nn.Module):
    """Modules of the plan applied in order (the embedding and its dropout, or the norm); a
    view outside the model's tree, so names stay the model's."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.parts:
            x = m(x)
        return x


class HFStages:
    """What the pipeline engine reads of a model (`spec`, `embed`, `blocks`, `norm`, `head`,
    `embed_tokens`, `output`), over a pruned transformers causal LM that keeps its own names.
    `embed` and `norm` are the plan's first module before and after the layers (tied weights
    and the chunk's parameters), or None where this stage does not hold them."""

    def __init__(self, model: nn.Module, spec) -> None:
        base = model.base_model
        before, layers, after = _plan(base)
        self.spec, self.pos_embed = spec, None
        self._before = [getattr(base, n) for n in before if getattr(base, n, None) is not None]
        self._after = [getattr(base, n) for n in after if getattr(base, n, None) is not None]
        self.embed = self._before[0] if self._before else None
        self.norm = _Sequence(self._after) if self._after else None
        self.head = model.get_output_embeddings()
        self.blocks = {
            i: _Layer(layer, base.rotary_emb, sliding_window(base.config, int(i)))
            for i, layer in getattr(base, layers).items()
        }

    def shard_sequence(self, shards: int) -> None:
        """Under tp + sp each stage receives s/`shards` tokens of every sequence: its layers
        rotate by the whole sequence's positions, as parallel/tensor.py `_whole_positions`
        hands the unsplit model's forward."""
        for block in self.blocks.values():
            block.sequence_shards = shards

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return _Sequence(self._before)(tokens)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


def prune_hf(model: nn.Module, spec, keep: set[int], first: bool, last: bool) -> HFStages:
    """Keep the layers `keep` (and the modules before them on the first stage, after them and
    the head on the last) of a meta causal LM, in place; layers keep their names."""
    base = model.base_model
    before, layers, after = _plan(base)
    number_routers(model)  # the MoE rows of the whole model, before the stage drops layers
    blocks = getattr(base, layers)
    setattr(base, layers, nn.ModuleDict({str(i): m for i, m in enumerate(blocks) if i in keep}))
    if not first:
        for name in before:
            setattr(base, name, None)
    if not last:
        for name in after:
            setattr(base, name, None)
        model.set_output_embeddings(None)
    return HFStages(model, spec)
