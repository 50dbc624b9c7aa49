"""Plain PyTorch models (no rank logic): specs, named presets, builders and initialisation.

Typical use, never holding the full model in memory before it is sharded::

    with torch.device("meta"):
        model = build_model(preset("7b"))
    ...  # parallelize, then materialise local shards
    model.to_empty(device=device)
    init_weights(model, seed)
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.decoder import Decoder
from shardwise.models.init import init_weights
from shardwise.models.presets import PRESETS, ModelSpec, preset
from shardwise.models.resnet import ResNet

__all__ = [
    "PRESETS",
    "Decoder",
    "ModelSpec",
    "ResNet",
    "build_model",
    "build_on_meta",
    "count_params",
    "init_weights",
    "preset",
    "to_empty",
]


def build_model(spec: ModelSpec) -> nn.Module:
    """Build the model for `spec` on the current default device, with torch's default init:
    its family's builder (models/families/).

    Use `build_on_meta` for models that do not fit, and `init_weights` after materialising:
    the values torch leaves here are not layout-invariant.
    """
    from shardwise.models.families import family_of

    return family_of(spec).build(spec)


def build_on_meta(spec: ModelSpec) -> nn.Module:
    """The model for `spec` on the meta device: shapes and structure, no memory."""
    with torch.device("meta"):
        return build_model(spec)


def to_empty(model: nn.Module, device: torch.device) -> None:
    """`Module.to_empty`, keeping tied parameters tied and the attributes set on them
    (tensor parallelism's slice marks): it creates new parameters module by module."""
    uses: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for module in model.modules():
        for leaf, p in module._parameters.items():
            if p is not None:
                uses.setdefault(id(p), (p, []))[1].append((module, leaf))
    model.to_empty(device=device)
    for old, group in uses.values():
        first = group[0][0]._parameters[group[0][1]]
        first.__dict__.update(old.__dict__)
        for module, leaf in group[1:]:
            module._parameters[leaf] = first


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of distinct parameters (a tied weight counts once); works on meta models.

    `exclude_embedding` drops parameters used only as lookup tables (token and position
    embeddings): they cost no FLOPs, so the 6N FLOPs-per-token estimate (Kaplan et al.
    2020; PaLM app. B) leaves them out. A weight tied to the output head is a matmul and
    stays counted (as nanoGPT and torchtitan do).
    """
    params = {id(p): p for p in model.parameters()}
    if exclude_embedding:
        lookup = {
            id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
        }
        other = {
            id(p)
            for m in model.modules()
            if not isinstance(m, nn.Embedding)
            for p in m.parameters(recurse=False)
        }
        for key in lookup - other:
            params.pop(key, None)
    return sum(p.numel() for p in params.values())
