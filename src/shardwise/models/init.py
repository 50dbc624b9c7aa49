"""Parameter initialisation as a function of (seed, parameter name) only.

Layout invariance (DESIGN.md): every parameter draws from its own CPU generator seeded by a
stable hash of ``f"{seed}:{name}"``, in float32, whatever the device, dtype, construction
order, or which other parameters exist. So a model built on meta and materialised per
shard, a pipeline stage holding a few blocks, or a tensor-parallel rank slicing
`initial_value(...)` all reproduce the single-device initialisation bit for bit.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from shardwise.models.decoder import LayerNorm, RMSNorm
from shardwise.models.presets import RESNET_ARCHS, ModelSpec
from shardwise.models.resnet import LAYOUTS

Rule = Callable[[torch.Tensor, torch.Generator], object]

BASE_STD = 0.02  # GPT-2 / BERT / Llama reference init for Linear and Embedding weights
FC_STD = 0.01  # ResNet classifier (as torchvision initialises its final Linear)
# Path segments inserted by wrappers (activation checkpointing, torch.compile, FSDP);
# removed so that wrapping a module never changes the names its init is keyed by.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_OUT_PROJ = re.compile(r"(^|\.)(attn\.wo|mlp\.w2)\.weight$")
_NORMS = (RMSNorm, LayerNorm, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def canonical_name(name: str, spec: ModelSpec | None = None) -> str:
    """The name a parameter's init is keyed by: wrapper segments removed, tied head -> embed."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    if spec is not None and spec.tie_embeddings and name == "head.weight":
        # A pipeline stage holding only the head must draw the same values as embed.weight.
        name = "embed.weight"
    return name


def param_seed(seed: int, name: str) -> int:
    """Stable 63-bit seed for one parameter (hashlib: Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _normal(std: float) -> Rule:
    return lambda t, g: nn.init.normal_(t, 0.0, std, generator=g)


def _zeros(t: torch.Tensor, g: torch.Generator) -> object:
    return nn.init.zeros_(t)


def _ones(t: torch.Tensor, g: torch.Generator) -> object:
    return nn.init.ones_(t)


def _kaiming(t: torch.Tensor, g: torch.Generator) -> object:
    # He et al. 2015 with fan_out, as torchvision's ResNet.
    return nn.init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu", generator=g)


def init_rule(module: nn.Module, leaf: str, name: str, spec: ModelSpec | None) -> Rule:
    """The one dispatch table: module type + (canonical) parameter name -> in-place init."""
    if leaf == "bias":
        return _zeros  # every bias: Linear, LayerNorm, BatchNorm
    if isinstance(module, _BatchNorm):
        # Zero gamma in the last BN of each residual branch, so every block starts as the
        # identity (Goyal et al. 2017, "Accurate, Large Minibatch SGD", §5.1); this
        # stabilises the large global batches that data parallelism brings.
        if spec is not None and spec.arch in RESNET_ARCHS:
            last_bn = LAYOUTS[spec.arch][0].last_bn
            if re.search(rf"(^|\.)layer\d+\.\d+\.{last_bn}\.weight$", name):
                return _zeros
        return _ones
    if isinstance(module, _NORMS):
        return _ones
    if isinstance(module, nn.Conv2d):
        return _kaiming
    if isinstance(module, nn.Linear) and spec is not None and spec.arch in RESNET_ARCHS:
        return _normal(FC_STD)
    if isinstance(module, nn.Linear) and _OUT_PROJ.search(name):
        # Residual output projections scaled by 1/sqrt(2 * n_layers): each block adds two
        # residual branches, so the residual stream's variance stays O(1) with depth
        # (Radford et al. 2019, GPT-2 §2.3; Megatron-LM `scaled_init_method_normal`).
        if spec is None:
            raise ValueError(f"{name}: scaled init needs n_layers; the model has no .spec")
        return _normal(BASE_STD / math.sqrt(2 * spec.n_layers))
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return _normal(BASE_STD)
    raise ValueError(
        f"no init rule for parameter {name!r} of {type(module).__name__}; "
        "add one to shardwise.models.init.init_rule"
    )


def initial_value(
    module: nn.Module,
    leaf: str,
    name: str,
    shape: tuple[int, ...],
    seed: int,
    spec: ModelSpec | None,
) -> torch.Tensor:
    """The float32 CPU value of parameter `name` (canonical, full/global `shape`).

    Sharding code slices this to get a local shard equal to the same slice of the full init.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(param_seed(seed, name))
    value = torch.empty(shape, dtype=torch.float32, device="cpu")
    init_rule(module, leaf, name, spec)(value, generator)
    return value


def find_spec(model: nn.Module) -> ModelSpec | None:
    """The `ModelSpec` of the (possibly wrapped) model, or None for a foreign module."""
    for module in model.modules():
        spec = getattr(module, "spec", None)
        if isinstance(spec, ModelSpec):
            return spec
    return None


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Initialise every parameter in place from (seed, name); reset BatchNorm statistics.

    Works on any materialised device and dtype, including a model built on meta and then
    `to_empty(device=...)`. A tied weight is initialised once, under its first name.
    """
    spec = find_spec(model)
    modules = dict(model.named_modules())
    for full_name, param in model.named_parameters(remove_duplicate=True):
        if param.is_meta:
            raise ValueError(
                f"parameter {full_name!r} is on the meta device; "
                "call model.to_empty(device=...) before init_weights"
            )
        owner, _, leaf = full_name.rpartition(".")
        name = canonical_name(full_name, spec)
        value = initial_value(modules[owner], leaf, name, tuple(param.shape), seed, spec)
        param.copy_(value)
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            module.reset_running_stats()
