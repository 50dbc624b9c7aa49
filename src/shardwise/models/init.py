"""Parameter initialisation as a function of (seed, parameter name) only.

Layout invariance (docs/design.md): every parameter draws from its own CPU generator seeded by a
stable hash of ``f"{seed}:{name}"``, in float32, whatever the device, dtype, construction
order, or which other parameters exist. So a model built on meta and materialised per
shard, a pipeline stage holding a few blocks, or a tensor-parallel rank slicing
`initial_value(...)` all reproduce the single-device initialisation bit for bit.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from shardwise.models.decoder import LayerNorm, RMSNorm
from shardwise.models.presets import RESNET_ARCHS, ModelSpec
from shardwise.models.resnet import LAYOUTS

Rule = Callable[[torch.Tensor, torch.Generator], object]

BASE_STD = 0.02  # GPT-2 / BERT / Llama reference init for Linear and Embedding weights
FC_STD = 0.01  # ResNet classifier (as torchvision initialises its final Linear)
# Path segments inserted by wrappers (activation checkpointing, torch.compile, FSDP, a peft
# LoRA layer around its base); removed so that wrapping a module never changes the names its
# init (or its checkpoint tensor) is keyed by.
_WRAPPER_SEGMENTS = (
    "_checkpoint_wrapped_module.",
    "_orig_mod.",
    "_fsdp_wrapped_module.",
    "base_layer.",
)
_LORA_A = re.compile(r"\.lora_A\.[^.]+\.weight$")
_LORA_B = re.compile(r"\.lora_B\.[^.]+\.weight$")
# LoRA pairs of stacked expert weights (models/expert_lora.py): `<experts>.lora_A.<weight>`
_EXPERT_A = re.compile(r"\.lora_A\.[^.]+$")
_EXPERT_B = re.compile(r"\.lora_B\.[^.]+$")
_OUT_PROJ = re.compile(r"(^|\.)(attn\.wo|mlp\.w2|mlp\.shared\.w2)\.weight$")
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


def _lora_a(t: torch.Tensor, g: torch.Generator) -> object:
    # peft's default for A (and nn.Linear's): Kaiming-uniform with a = sqrt(5)
    return nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)


def _expert_lora_a(t: torch.Tensor, g: torch.Generator) -> object:
    # [E, r, in]: each expert's A as _lora_a draws an [r, in] one (bound 1 / sqrt(in)); torch's
    # fan-in of a 3-D tensor would be r·in
    bound = 1.0 / math.sqrt(t.shape[-1])
    return nn.init.uniform_(t, -bound, bound, generator=g)


def _is_adapter(name: str) -> bool:
    return any(r.search(name) for r in (_LORA_A, _LORA_B, _EXPERT_A, _EXPERT_B))


def init_rule(module: nn.Module, leaf: str, name: str, spec: ModelSpec | None) -> Rule:
    """The one dispatch table: module type + (canonical) parameter name -> in-place init."""
    if _LORA_B.search(name) or _EXPERT_B.search(name):
        return _zeros  # LoRA starts as the base model: B·A = 0 (Hu et al. 2021, §4.1)
    if _LORA_A.search(name):
        return _lora_a
    if _EXPERT_A.search(name):
        return _expert_lora_a
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
    if isinstance(module, _NORMS) or type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
        return _ones  # also Hugging Face's own norm classes (LlamaRMSNorm, ...)
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
    if isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ == "Conv1D":
        return _normal(BASE_STD)  # Conv1D: GPT-2's transposed Linear in transformers
    stacked = getattr(module, "init_std", None)  # stacked weights (models/moe.py experts)
    if callable(stacked) and spec is not None:
        return _normal(stacked(leaf, spec))
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
    if (
        spec is not None and spec.arch == "custom" and not _is_adapter(name)
    ):  # its own reset_parameters()
        from shardwise.models.custom import reset_value

        return reset_value(module, leaf, param_seed(seed, name.rpartition(".")[0]))
    generator = torch.Generator(device="cpu")
    generator.manual_seed(param_seed(seed, name))
    value = torch.empty(shape, dtype=torch.float32, device="cpu")
    init_rule(module, leaf, name, spec)(value, generator)
    return value


@dataclass(frozen=True)
class LocalSlice:
    """Where a sharded parameter's local tensor comes from in its full value: the pieces
    `ranges` of dimension `dim`, concatenated (one piece for a plain shard, three for a fused
    q|k|v weight), with the full dimension zero-padded to `padded` (vocabulary padding).

    Tensor parallelism attaches one to each parameter it shards (``param.tp_slice``); init and
    the gather back to full shape read it, so a shard always equals the same slice of the
    single-process parameter."""

    full_shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]
    padded: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The local piece of a full (unpadded) tensor."""
        if self.padded > full.shape[self.dim]:
            pad = list(full.shape)
            pad[self.dim] = self.padded - full.shape[self.dim]
            full = torch.cat([full, full.new_zeros(pad)], dim=self.dim)
        return torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.ranges], self.dim)

    def place(self, local: torch.Tensor) -> torch.Tensor:
        """A zero tensor of the padded full shape holding `local` where it came from; the sum
        of every rank's `place` is the full (padded) value."""
        shape = list(self.full_shape)
        shape[self.dim] = self.padded
        full = local.new_zeros(shape)
        at = 0
        for a, b in self.ranges:
            full.narrow(self.dim, a, b - a).copy_(local.narrow(self.dim, at, b - a))
            at += b - a
        return full


def initial_local(
    module: nn.Module, leaf: str, name: str, param: torch.Tensor, seed: int, spec
) -> torch.Tensor:
    """The float32 CPU initial value of this rank's `param` (a full parameter or a shard).

    A shard is cut from the full value: the full tensor is drawn and sliced, one parameter at
    a time. Drawing only the slice is not possible in general: torch's CPU normal_ fills in
    blocks (Box-Muller over 16 values), so a slice of the stream is not a stream of a slice."""
    cut: LocalSlice | None = getattr(param, "tp_slice", None)
    shape = cut.full_shape if cut is not None else tuple(param.shape)
    value = initial_value(module, leaf, name, shape, seed, spec)
    return cut.take(value) if cut is not None else value


def restore_buffers(model: nn.Module) -> None:
    """Non-persistent buffers computed at construction (a foreign model's RoPE frequencies)
    are lost when the model is built on meta; their values are kept in
    ``model.shardwise_buffers`` (name -> CPU tensor) by the builder and copied back here."""
    values: dict[str, torch.Tensor] = getattr(model, "shardwise_buffers", {})
    if not values:
        return
    owners = dict(model.named_modules())
    for name, value in values.items():
        owner, _, leaf = name.rpartition(".")
        module = owners[owner]
        old = module._buffers[leaf]
        device = old.device if old is not None and not old.is_meta else value.device
        module._buffers[leaf] = value.to(device).clone()


def persistent_named_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) of every persistent buffer of `model`: the state saved with the weights
    that is no parameter (BatchNorm statistics, a routing bias), non-persistent ones left out."""
    for path, module in model.named_modules():
        for leaf, buf in module._buffers.items():
            if buf is not None and leaf not in module._non_persistent_buffers_set:
                yield (f"{path}.{leaf}" if path else leaf), buf


def take_buffers(model: nn.Module, source) -> None:
    """Persistent buffers a weight `source` holds (a transformers class's routing biases,
    models/hf/buffers.py) replace the constructor's values in ``model.shardwise_buffers``, so
    `restore_buffers` puts the checkpoint's back on every rank, in any layout."""
    values = source.buffers(model) if source is not None else {}
    if values:
        model.shardwise_buffers = {**getattr(model, "shardwise_buffers", {}), **values}


def find_spec(model: nn.Module) -> ModelSpec | None:
    """The `ModelSpec` of the (possibly wrapped) model, or None for a foreign module."""
    for module in model.modules():
        for attr in ("spec", "shardwise_spec"):  # ours / a foreign module's (custom, ...)
            spec = getattr(module, attr, None)
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
        param.copy_(initial_local(modules[owner], leaf, name, param, seed, spec))
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            module.reset_running_stats()
    restore_buffers(model)
