"""Context parallelism inside transformers' own attention: Llama-style causal LMs
(`model.name=hf-llama-*`, and `model.name=hf` with a Llama, Mistral, Qwen2 or Qwen3
checkpoint) split the sequence with the kernels of parallel/context_comm.py, their modelling
code untouched.

transformers' attention modules call the function its registry (`AttentionInterface`) holds
under `config._attn_implementation`, with q [B, H, S, D] and k/v [B, KV, S, D] after RoPE.
`cp_attention` is registered under `CP_ATTENTION` and selected in the model's config, so every
layer attends over the whole sequence through the cp context the transformation leaves on it.
An implementation that transformers' mask registry does not know builds no mask
(masking_utils `_preprocess_mask_arguments`: custom attention without mask creation), so no
causal mask of the local length is made; the kernels mask by global position. A forward
pre-hook passes the global positions of the local tokens as `position_ids`, so the rotary
embedding rotates each token by its place in the whole sequence. Under tp an attention module
reshapes q/k/v to the heads its rank holds, so the kernels run over those; under pp the model's
forward (and the pre-hook) does not run, and the stages of parallel/pipeline_hf.py read the
same positions from the context of their layer's attention module.

Packed rows (data.pack): the model receives this rank's part of each row as [B, 3, S/cp] (ids,
record numbers, positions within the record; parallel/context.py `sequence_part`), and
models/packing.py `take_packed_tokens` hands RoPE those within-record positions, as it does in
one process. The attention function is given nothing that tells records apart (no mask is
built, and transformers passes no positions to it), so the pre-hook leaves the part's
positions on the context, and the kernels mask each query to its record from where the record
starts: its global position minus its position within the record."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.packing import Packed, is_packed

CP_ATTENTION = "shardwise_cp"
CONTEXT = "shardwise_cp_context"  # the attribute of an attention module holding the context
# transformers' attention modules hold their GQA ratio under this name (read by sdpa_attention
# too): the modules the attention function receives, and so the ones given the context
CONTEXT_HOLDER = "num_key_value_groups"


def cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [B, S, H, D] out, no weights. Only what the
    kernels compute exactly is accepted: no mask, no dropout, the 1/sqrt(D) scale, no window
    shorter than the sequence, no soft-capping."""
    context = getattr(module, CONTEXT, None)
    if context is None:
        raise RuntimeError(
            f"{type(module).__name__} runs the cp attention without a cp context: "
            "apply_context_parallel sets one on every attention module of the model"
        )
    whole = query.shape[2] * context.cp
    unexact = {
        "an attention mask": attention_mask is not None,
        f"dropout {dropout}": bool(dropout),
        f"scale {scaling}": scaling is not None and scaling != query.shape[-1] ** -0.5,
        f"sliding window {sliding_window} < {whole} tokens": bool(sliding_window)
        and sliding_window < whole,
        "soft-capping": kwargs.get("softcap") is not None,
    }
    refused = [what for what, bad in unexact.items() if bad]
    if refused:
        raise ConfigError(
            f"parallel.cp: {type(module).__name__} asks for {', '.join(refused)}, which the cp "
            "attention kernels do not compute. Fix: --parallel.cp=1."
        )
    # k/v heads repeated to the query heads, as transformers' sdpa_attention does (repeat_kv):
    # query head h reads kv head h // (H / KV), and the kernels take equal head counts
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = context.attend(query, key, value, context.packed)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention)


def apply_to_transformers(model: nn.Module, context) -> bool:
    """Switch a transformers causal LM's attention to the cp kernels over `context`
    (parallel/context.py `SequenceContext`) and feed it global positions; False when `model`
    is not a transformers model (nothing done)."""
    if not hasattr(model, "set_attn_implementation"):
        return False
    _register()
    model.set_attn_implementation(CP_ATTENTION)
    modules = [m for m in model.modules() if hasattr(m, CONTEXT_HOLDER)]
    if not modules:
        raise ConfigError(
            f"parallel.cp: {type(model).__name__} has no attention module that calls "
            "transformers' attention functions. Fix: --parallel.cp=1."
        )
    for module in modules:
        setattr(module, CONTEXT, context)

    def positions(_model, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        if is_packed(ids):  # [B, 3, S/cp]: RoPE gets ids[:, 2] from take_packed_tokens
            context.packed = Packed(ids[:, 2], None)
            return args, kwargs
        context.packed = None
        kwargs["position_ids"] = context.positions(ids.shape[1], ids.device)[None]
        return args, kwargs

    model.register_forward_pre_hook(positions, with_kwargs=True)
    return True


def hf_cp_refusal(config, model_types: tuple[str, ...], seq_len: int) -> str:
    """Before launch: why parallel.cp cannot split a checkpoint of this transformers `config`
    ("" when it can): its attention must be one of `model_types` (rotary positions from
    `position_ids`, the attention registry, the 1/sqrt(D) scale) and see the whole sequence."""
    kind = getattr(config, "model_type", "?")
    if kind not in model_types:
        return (
            f"model.init_from holds a '{kind}' model, and the cp attention replaces the "
            f"attention of {', '.join(model_types)} models only (others scale, cap, window or "
            "position their attention in ways the cp kernels do not reproduce). Fix: "
            "--parallel.cp=1 (data parallelism and ZeRO-3 split it)."
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and window < seq_len:
        return (
            f"the '{kind}' checkpoint attends within a sliding window of {window} tokens, "
            f"shorter than data.seq_len={seq_len}, and the cp kernels attend over the whole "
            f"causal past. Fix: --data.seq_len={window} or less, or --parallel.cp=1."
        )
    return ""
