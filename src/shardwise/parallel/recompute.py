"""Activation recomputation as a transformation: which modules to recompute is data.

`full` recomputes whole transformer blocks (only each block's input is saved, 2sbh bytes per
layer in bf16 as in Korthikanti et al. 2022); `selective` recomputes the cheap element-wise
internals (RoPE + attention core, the MLP activation product) while the matmul outputs, which
are expensive to recompute and cheap to keep, stay saved. The forward is patched in place so
parameter names (and hence layout-invariant init and checkpoints) are unchanged.
"""

from __future__ import annotations

import contextlib
import fnmatch

from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.distributed.clock import clock
from shardwise.errors import ConfigError
from shardwise.models.families import Family
from shardwise.parallel.deferred_grads import recompute_context

PLANS: dict[str, dict[str, list[str]]] = {
    "decoder": {"full": ["blocks.*"], "selective": ["blocks.*.attn.core", "blocks.*.mlp.act"]},
    "gpt2": {"full": ["blocks.*"], "selective": ["blocks.*.attn.core", "blocks.*.mlp.act"]},
    # an MoE layer names its experts' SwiGLU product `act` too (models/moe.py)
    "moe": {"full": ["blocks.*"], "selective": ["blocks.*.attn.core", "blocks.*.mlp.act"]},
    "resnet": {"full": ["layer*.*"]},
}


def _checkpointed(forward):
    def run(*args, **kwargs):
        # the recomputation runs in the forward's context: zero bubble's deferring ops save
        # other tensors than the plain ones, and checkpoint checks they match
        # (timed apart from the backward it runs in: the ledger's recompute_s)
        again = _Timed(recompute_context())
        contexts = lambda: (contextlib.nullcontext(), again)  # noqa: E731
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run


class _Timed:
    """`context`, its time charged to the ledger's recompute_s; entered anew by each
    recomputation (a backward that keeps its graph recomputes a region twice)."""

    def __init__(self, context) -> None:
        self.context = context

    def __enter__(self) -> None:
        global _depth
        self._phase = clock().phase("recompute")
        self._phase.__enter__()
        self.context.__enter__()
        _depth += 1

    def __exit__(self, *exc) -> None:
        global _depth
        _depth -= 1
        try:
            self.context.__exit__(*exc)
        finally:
            self._phase.__exit__(*exc)


_depth = 0  # recomputations running now (a module updating state counts a forward once)


def recomputing() -> bool:
    """True inside a recomputed forward (activation checkpointing's replay in backward)."""
    return _depth > 0


def _blocks(model: nn.Module, mode: str) -> list[str] | None:
    """A user's module: `full` recomputes each block of its top-level containers
    (ModuleList, ModuleDict, Sequential), the same blocks ZeRO makes units of."""
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    names = [f"{n}.*" for n, child in model.named_children() if isinstance(child, containers)]
    if mode != "full":
        return None
    if not names:
        raise ConfigError(
            "memory.recompute='full' recomputes the blocks of a model's top-level "
            "nn.ModuleList / nn.Sequential, and this model has none. Fix: hold the repeated "
            "blocks in an nn.ModuleList, or --memory.recompute=none."
        )
    return names


def _hf_blocks(model: nn.Module, mode: str) -> list[str] | None:
    """A transformers model: `full` recomputes each instance of its repeated block class."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    if mode != "full":
        return None
    return [n for n, m in model.named_modules() if n and type(m).__name__ in blocks]


def block_names(model: nn.Module, family: Family) -> list[str]:
    """The names of `model`'s blocks: what full recomputation wraps (and compilation
    compiles, parallel/compile.py); a transformers class without a recomputation plan of
    ours (the hf-* presets): each instance of its repeated block class."""
    if family.recompute == "plans" and "full" not in PLANS.get(family.name, {}):
        return _matching(model, _hf_blocks(model, "full"))
    return _matching(model, _patterns(model, family, "full"))


def apply_recompute(model: nn.Module, family: Family, mode: str) -> int:
    """Wrap the modules that `mode` names for `family`; returns how many were wrapped."""
    if mode == "none":
        return 0
    names = set(_matching(model, _patterns(model, family, mode)))
    for name, module in model.named_modules():
        if name in names:
            module.forward = _checkpointed(module.forward)
    return len(names)


def _patterns(model: nn.Module, family: Family, mode: str) -> list[str]:
    if family.recompute == "checkpoint_blocks":
        patterns = _hf_blocks(model, mode)
    elif family.recompute == "containers":
        patterns = _blocks(model, mode)
    else:
        patterns = PLANS.get(family.name, {}).get(mode)
    if patterns is None:
        # a transformers class or a user's module recomputes whole blocks only (`_hf_blocks`,
        # `_blocks`); the built-in families have the plans they list
        whole = family.recompute in ("checkpoint_blocks", "containers")
        modes = ", ".join(["none", *(["full"] if whole else PLANS.get(family.name, {}))])
        raise ConfigError(
            f"memory.recompute='{mode}' is not available for {family.name} models. "
            f"Fix: choose one of {modes}."
        )
    return patterns


def _matching(model: nn.Module, patterns: list[str]) -> list[str]:
    return [
        name
        for name, _ in model.named_modules()
        if any(fnmatch.fnmatchcase(name, p) and name.count(".") == p.count(".") for p in patterns)
    ]
