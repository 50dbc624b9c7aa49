"""What the planner's measured path (job/measured.py, job/stages.py) needs to price expert
parallelism (parallel/expert.py) from the real model: the expert units apart from the dense
ones, and the MoE shape of a transformers MoE model, whose spec has none."""

from __future__ import annotations

import dataclasses

import torch

from shardwise.models.hf.experts import experts_modules, routers
from shardwise.models.presets import ModelSpec
from shardwise.parallel.expert import is_expert_weight
from shardwise.parallel.zero_units import unit_roots
from shardwise.plan.shapes import Unit, split_trainable


def expert_units(model: torch.nn.Module, ep: int) -> tuple[list[Unit], list[Unit]]:
    """`model_units` with every MoE layer's routed experts apart, at this rank's 1/ep of them:
    expert parallelism gives them units of their own over the dp / ep ranks holding the same
    experts (parallel/expert.py, parallel/zero.py)."""
    dense, experts = [], []
    for name, entries, _ in unit_roots(model):
        kept, split = [], []
        for _, module, leaf, p in entries:
            if is_expert_weight(module, leaf):
                shape = (p.shape[0] // ep, *p.shape[1:])
                split.append((p.numel() // ep, p.requires_grad, shape))
            else:
                kept.append((p.numel(), p.requires_grad, tuple(p.shape)))
        dense += [Unit(name, tuple(kept))] if kept else []
        experts += [Unit(f"{name}[experts]", tuple(split))] if split else []
    return split_trainable(dense), split_trainable(experts)


def in_forward_order(dense: list[Unit], experts: list[Unit]) -> list[Unit]:
    """Dense and expert units in the order ZeRO reduces and gathers them (parallel/zero.py):
    each root's expert unit right after its dense ones, so that the transient buffers'
    replay (plan/buffers.py) sees the gradients in flight the engine holds."""
    out, by_root = [], {u.name.removesuffix("[experts]"): u for u in experts}
    for i, u in enumerate(dense):
        out.append(u)
        root = u.name.removesuffix("[frozen]")
        last = i + 1 == len(dense) or dense[i + 1].name.removesuffix("[frozen]") != root
        if last and root in by_root:
            out.append(by_root.pop(root))
    return out + list(by_root.values())


def routed_spec(spec: ModelSpec, model: torch.nn.Module) -> ModelSpec:
    """`spec` with its MoE shape (experts, top-k, every how many blocks) read from a
    transformers MoE model's stacked experts and routers where the spec has none."""
    layers, routing = experts_modules(model), routers(model)
    if spec.n_experts or not layers or not routing:
        return spec
    every = max(1, spec.n_layers // len(layers))
    k = int(routing[0].top_k)
    return dataclasses.replace(spec, n_experts=int(layers[0].num_experts), top_k=k, moe_every=every)
