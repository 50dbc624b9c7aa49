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
from shardwise.plan.buffers import up
from shardwise.plan.layout import Job, Layout
from shardwise.plan.shapes import Unit, split_trainable
from shardwise.plan.traffic import ring_share


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


def whole_moe_tp(comm: dict, calls: dict, job: Job, layout: Layout, model: torch.nn.Module) -> None:
    """tp + sp of a transformers MoE model (`comm`, `calls`: plan/traffic's, which prices its
    blocks as dense): its MoE MLPs run whole on each rank's sequence shard (parallel/tensor.py
    drops their plan entries), so no all-gather/reduce-scatter pair around them forward or
    backward (nor the all-gather a full recomputation replays), and their parameters'
    gradients (the router, shared experts and, without ep, the experts) join the partial
    all-reduce over tp. `model`: the rank's meta model (under pp its stage's: only its own MoE
    layers). Ours are priced in plan/traffic.py (its spec has n_experts)."""
    if layout.tp == 1 or not layout.sp or job.spec.n_experts:
        return
    held = {id(r) for r in routers(model)}
    blocks = [m for m in model.modules() if any(id(c) in held for c in m.children())]
    if not blocks:
        return
    m, t, n = layout.micro_batches(job), layout.tp, len(blocks)
    act = layout.micro_batch * job.seq_len * job.spec.dim * job.bc
    # forward and backward an all-gather/reduce-scatter pair each; a replayed forward (full
    # recomputation) only the all-gather: the replay stops at the block's last saved tensor,
    # so plan/traffic.py's dense replay has no MLP reduce-scatter to take away
    gone = 4 + (layout.recompute == "full")
    comm["tp"] -= ring_share(t) * m * act * gone * n
    calls["tp"] -= m * gone * n
    whole = [
        p.numel()
        for block in blocks
        for module in block.modules()
        for leaf, p in module.named_parameters(recurse=False)
        if layout.ep == 1 or not is_expert_weight(module, leaf)
    ]
    comm["tp"] += 2 * ring_share(t) * sum(whole) * 4  # fp32 master gradients, once a step


def partial_in_slice(model: torch.nn.Module, layout: Layout, align: int) -> tuple[int, int]:
    """(elements of trainable tp-`partial` parameters (parallel/tensor.py) in rank 0's ZeRO
    slices, in all): under ZeRO-1/2/3 the optimizer hands parallel/tensor.py's reduce_partial
    only the pieces of its own slice of each unit (zero_units.Unit.targets), so a rank sums
    over tp only those. The units are the engine's (parallel/zero.py): per root, trainable
    parameters apart from frozen ones and, under ep, the experts apart (tp shards, never
    partial); each a flat buffer (parameters at multiples of `align`) split evenly over the
    `layout.dp` ranks of the dp line. Rank 0's slice, as metrics.jsonl's `comm_bytes` are
    rank 0's own (not reduced over ranks)."""
    inside = total = 0
    for _, entries, _ in unit_roots(model):
        groups: dict[tuple[bool, bool], list[tuple[int, bool]]] = {}
        for _, module, leaf, p in entries:
            expert = layout.ep > 1 and is_expert_weight(module, leaf)
            partial = getattr(p, "tp_kind", "") == "partial"
            groups.setdefault((p.requires_grad, expert), []).append((p.numel(), partial))
        for (trainable, expert), members in groups.items():
            if trainable and not expert:
                got, whole = _partial_of_unit(members, layout.dp if layout.zero else 1, align)
                inside, total = inside + got, total + whole
    return inside, total


def _partial_of_unit(members: list[tuple[int, bool]], n: int, align: int) -> tuple[int, int]:
    """(partial elements in slice 0 of a unit of `members` (numel, partial) over `n` ranks,
    in all), laid out as zero_units.Unit does."""
    offsets, end = [], 0
    for numel, _ in members:
        offsets.append(end)
        end = up(end + numel, align)
    hi = up(-(-end // n), align)  # slice 0 ends at the shard size
    inside = sum(
        max(0, min(off + numel, hi) - off)
        for off, (numel, partial) in zip(offsets, members, strict=True)
        if partial
    )
    return inside, sum(numel for numel, partial in members if partial)
