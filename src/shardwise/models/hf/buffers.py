"""Persistent buffers of a transformers class (`model.name=hf`): state saved with the weights
that is no parameter, such as GLM-4-MoE's and DeepSeek-V3's routing bias
`e_score_correction_bias`.

They are read from the checkpoint's safetensors like the parameters (whole, on every rank that
holds the module: a buffer is never split over ranks), kept as state that is not trained,
saved in shardwise's checkpoints (`buffer/<name>`, checkpoint/state.py) so a resume restores
them, and written back by `shardwise export --format hf` under the class's own names. A buffer
the checkpoint lacks is refused before launch rather than left at its constructor's value.
Non-persistent buffers (RoPE tables) are computed, as before (init.restore_buffers).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.errors import ConfigError, ShardwiseError
from shardwise.models.init import canonical_name, persistent_named_buffers


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by their names in a checkpoint (wrapper segments out)."""
    return {canonical_name(name): buf for name, buf in persistent_named_buffers(model)}


def missing_message(source: str, cls: str, missing: list[str], where: str, fix: str) -> str:
    """One message naming the first buffer `where` does not hold, and the fix."""
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return (
        f"model.init_from='{source}': {cls} keeps state that is not a parameter "
        f"({missing[0]}{more}: persistent buffers), and {where} does not hold it, so it would "
        f"be the constructor's value instead of the trained one. Fix: {fix}"
    )


def check_buffers(spec, model: nn.Module, source) -> None:
    """Before launch: every persistent buffer is in the checkpoint, at the model's shape."""
    held = persistent_buffers(model)
    missing = [name for name in held if source.key(name) is None]
    if missing:
        fix = (
            "a checkpoint saved with its buffers (transformers' save_pretrained and "
            "`shardwise export --format hf` write them)."
        )
        cls = type(model).__name__
        raise ConfigError(missing_message(spec.source, cls, missing, "its safetensors", fix))
    for name, buf in held.items():
        check_shape(spec, source, name, tuple(buf.shape), "buffer ")


def check_shape(spec, source, name: str, shape: tuple[int, ...], kind: str = "") -> None:
    """Refuse the checkpoint's tensor for the model's `name` unless it has the model's `shape`
    (`kind`: "buffer " for a persistent buffer, "" for a parameter)."""
    got = source.shape(name)
    if got != shape:
        raise ConfigError(
            f"model.init_from='{spec.source}': '{source.key(name)}' has shape {list(got)} but "
            f"the model's {kind}'{name}' is {list(shape)}. Fix: the checkpoint of this config."
        )


def read_buffers(model: nn.Module, source) -> dict[str, torch.Tensor]:
    """The values of the persistent buffers of `model` (a rank's part of it: only the modules
    it holds) from the weight `source`, each in the dtype its class keeps it in, on the CPU,
    by the model's own names. Every buffer of the class was checked to be in the checkpoint
    before launch (`check_buffers`); one a shardwise transformation adds keeps its value."""
    out = {}
    for name, buf in persistent_named_buffers(model):
        held = canonical_name(name)
        if source.key(held) is not None:
            out[name] = source.whole(held).reshape(buf.shape).to(buf.dtype)
    return out


def export_buffers(spec, model: nn.Module, buffers: dict[str, torch.Tensor]) -> dict:
    """The persistent buffers of `model` (the class, built on meta) for `shardwise export
    --format hf`, from the run's buffers by name, each in the dtype the run kept it in
    (transformers keeps GLM-4-MoE's routing bias in fp32 whatever the weights' dtype)."""
    saved = {canonical_name(k): v for k, v in buffers.items()}
    held = persistent_buffers(model)
    missing = [name for name in held if name not in saved]
    if missing:
        fix = "export a checkpoint that shardwise's training wrote (it saves the buffers)."
        cls = type(model).__name__
        raise ShardwiseError(
            missing_message(spec.source, cls, missing, "the run's checkpoint", fix)
        )
    return {name: saved[name].contiguous() for name in held}
