"""One parameter of our decoders and the Hugging Face tensor that holds it (models/hf/llama.py
and gpt2.py list them): the map is data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """Our parameter `ours` (a regex over our names) is `theirs` (a format string of the
    regex groups), transposed for Conv1D, or block `part` of `parts` along their out axis.
    `stacked`: our experts [E, in, out] (models/moe.py), theirs [E, out·parts, in] (each
    expert as an nn.Linear weight: transformers' stacked experts, models/hf/qwen2_moe.py)."""

    ours: str
    theirs: str
    transposed: bool = False
    part: int = 0
    parts: int = 1
    stacked: bool = False


def hf_shape(rule: Rule, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the Hugging Face tensor that holds our parameter of `shape`."""
    if rule.stacked:
        return (shape[0], shape[2] * rule.parts, shape[1])
    out = (shape[0] * rule.parts, *shape[1:])
    return (out[1], out[0]) if rule.transposed else out


def unsupported(path: str | Path, what: str) -> ConfigError:
    return ConfigError(
        f"model.init_from='{path}': {what}, which shardwise's decoders do not implement. "
        "Fix: start from a plain Llama or GPT-2 checkpoint."
    )
