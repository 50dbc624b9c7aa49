"""The ZeRO units and quantised linears of a fine-tuning job (finetune/: LoRA through peft, a
low-bit frozen base), as the engine builds them: the formula's units with every base frozen,
a rank-r pair beside each adapted linear, and a quantised base kept outside the units."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby

from shardwise.models import ModelSpec
from shardwise.models.moe import is_moe_block
from shardwise.plan import moe
from shardwise.plan.layout import Job
from shardwise.plan.shapes import (
    Unit,
    block_entries,
    dense_spec,
    moe_block_entries,
    split_trainable,
)


def block_quantised(job: Job, i: int, targets: tuple[str, ...]) -> list[tuple[int, int]]:
    """(out, in) of block `i`'s quantised linears: those LoRA adapts there."""
    spec, shapes = job.spec, moe.lora_shapes(job.spec)
    entries = block_entries(dense_spec(spec))
    if is_moe_block(spec, i):
        entries = moe_block_entries(spec, 1, entries)
    return adapted_linears(spec, shapes, entries, targets)


def adapted_linears(
    spec: ModelSpec, shapes: dict, entries: Iterable[tuple], targets: tuple[str, ...]
) -> list[tuple[int, int]]:
    """(out, in) of the linears among block `entries` that LoRA on `targets` adapts (`shapes`:
    moe.lora_shapes; an expert's tag is its shape, never a target)."""
    tags = [(e[0], e[2]) for e in entries if len(e) > 2 and e[2] in targets]
    return [linear_fans(spec, shapes, tag, n)[::-1] for n, tag in tags]


def linear_fans(spec, shapes: dict, tag: str, numel: int) -> tuple[int, int]:
    """(fan_in, fan_out) of the block linear `tag` holding `numel` elements (`shapes`:
    moe.lora_shapes): a shared expert is whole on every tp rank, its hidden width
    ffn_dim·n_shared (moe.moe_block_entries); the dim side stays."""
    fan_in, fan_out = shapes[tag]
    if fan_in * fan_out == numel:
        return fan_in, fan_out
    wide = numel // spec.dim
    return (wide, fan_out) if tag == "w2" else (fan_in, wide)


def finetune_units(us: list[Unit], job: Job, tp: int) -> list[Unit]:
    """LoRA: every base parameter frozen, rank-r A and B beside each targeted linear (trainable,
    in compute dtype) and after an MoE block's experts their pairs (`moe.adapter_entries`);
    QLoRA: the targeted linears' weights leave the units (finetune/quant keeps them beside
    them, `quantised_layers`). Targets naming some blocks only: each block by its own."""
    ft, out = job.finetune, []
    shapes = moe.lora_shapes(job.spec, tp)
    for u in us:
        if u.name == "blocks" and u.count == len(ft.lora_layers):  # (pp = 1: every block)
            for tags, run in groupby(ft.lora_layers):
                out.append(
                    Unit(u.name, adapted_entries(u.entries, job, shapes, tags), len(list(run)))
                )
            continue
        entries = adapted_entries(u.entries, job, shapes, ft.lora_targets)
        if any(moe.is_expert_entry(e, job.spec) for e in u.entries):
            entries += tuple(moe.adapter_entries(job.spec, ft))
        out.append(Unit(u.name, entries, u.count))
    return split_trainable(out)


def adapted_entries(entries: tuple, job: Job, shapes: dict, targets: tuple[str, ...]) -> tuple:
    """A unit's entries with LoRA on `targets`: the base frozen (a quantised one gone), a pair
    beside each adapted linear."""
    ft, out = job.finetune, []
    for e in entries:
        tag = e[2] if len(e) > 2 else ""
        if not (ft.quantised and ft.lora and tag in targets):
            out.append((e[0], not ft.lora, tag, job.bc))
        if ft.lora and tag in targets:
            fan_in, fan_out = linear_fans(job.spec, shapes, tag, e[0])
            out += [
                (ft.lora_rank * fan_in, True, "lora_A"),
                (fan_out * ft.lora_rank, True, "lora_B"),
            ]
    return tuple(out)
