"""Sliding-window attention of transformers' classes (Mistral and Mixtral: every layer; Qwen2
and Qwen2-MoE: the layers `layer_types` marks `sliding_attention`) where shardwise runs a
layer over a sequence the model's own forward did not see whole: a pipeline stage's layers
(parallel/pipeline_hf.py) and, under sequence parallelism, the whole model whose forward
builds its masks from the s/tp tokens its embedding leaves (parallel/tensor.py). Both get the
boolean mask transformers' create_sliding_window_causal_mask builds for SDPA over all s tokens.
"""

from __future__ import annotations

import weakref

import torch
from torch._guards import detect_fake_mode


def sliding_window(config, index: int) -> int | None:
    """The window layer `index` attends within (None: the whole causal past), as the model's
    forward picks its mask: by `layer_types` where the config lists them, else the config's
    `sliding_window` for every layer (None or absent: no window)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return config.sliding_window if types[index] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def window_mask(s: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """The boolean [1, 1, s, s] mask (True attends) of causal attention within `window` tokens
    over positions 0..s-1: key k is seen by query q when q - window < k <= q. None (SDPA's
    is_causal, the same attention) while the sequence is no longer than the window. One tensor
    for every layer of a forward, as the model's forward builds one for all its layers: it is
    kept while something holds it (the layers' saved tensors, until their backward), so no
    mask outlives the step (a fake tensor mode, the planner's forward, keeps its own)."""
    if window is None or s <= window:
        return None
    key = (s, window, device, detect_fake_mode())
    mask = _MASKS.get(key)
    if mask is None:
        q = torch.arange(s, device=device)[:, None]
        k = torch.arange(s, device=device)[None, :]
        mask = _MASKS[key] = ((k <= q) & (k > q - window))[None, None]
    return mask


# the masks alive, by (s, window, device, fake mode): an entry goes with its last holder
_MASKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def whole_sequence_masks(config, s: int, device: torch.device) -> torch.Tensor | dict | None:
    """The `attention_mask` to hand a transformers model's forward whose layers see all `s`
    tokens while its embedding leaves fewer (sequence parallelism): None where no layer's
    window is shorter than s (its own causal masks are right); Qwen2's mapping of mask kinds
    (its forward takes one as given) where `layer_types` mixes them; else (Mistral, Mixtral)
    the one 4-D mask, which transformers' mask builders return as given."""
    window = getattr(config, "sliding_window", None)
    mask = window_mask(s, window, device)
    if mask is None:
        return None
    if getattr(config, "layer_types", None) is not None:
        return {"full_attention": None, "sliding_attention": mask}
    return mask
