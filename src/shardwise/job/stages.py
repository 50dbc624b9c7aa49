"""The planner's prediction of a Hugging Face causal LM or our MoE decoder cut into pipeline
stages: each stage's model states from its own units, its activations from a fake forward of
the chunks it holds (job/fake.py), the busiest stage per category."""

from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise.config import Config
from shardwise.distributed import device as dev
from shardwise.finetune.quant import quant_layers
from shardwise.job.experts import expert_units, in_forward_order, routed_spec, whole_moe_tp
from shardwise.job.fake import (
    as_in_training,
    as_trained,
    loss_sum,
    meta_model,
    model_units,
    split_tp,
    to_fake,
)
from shardwise.job.measured import (
    exchange_saved_bytes,
    expert_traffic,
    repeated_kv_bytes,
    sliced_partial_tp,
    zero_buffers,
)
from shardwise.parallel.expert import holds_routed_experts
from shardwise.plan import activations as act
from shardwise.plan import memory as mem
from shardwise.plan import traffic
from shardwise.plan.buffers import align_of
from shardwise.plan.layout import Job, Layout, as_data_parallel
from shardwise.plan.stage_chunks import interleaved_held
from shardwise.plan.states import add_states, model_states
from shardwise.training.memory import ActivationMeter, tensor_bytes


def _stage_model(cfg: Config, derived, layout: Layout, stage: int):
    """(the decoder-shaped view of pipeline rank `stage`'s meta model, its ZeRO units), cut as
    training cuts it (parallel/pipeline_split)."""
    from shardwise.parallel.pipeline_split import plan_chunks, prune_to_stage

    model = meta_model(cfg, derived.spec)
    p, v = layout.pp, layout.pp_virtual
    chunks = plan_chunks(derived.spec, p, v, cfg.parallel.pp_split, cfg.data.seq_len)
    hf = derived.spec if derived.family.from_checkpoint else None  # cut by its own plan
    mine, view = prune_to_stage(model, chunks, stage, p, hf)
    tp = split_tp(model, cfg, derived)
    if hf is not None and cfg.parallel.sp:  # as parallel/pipeline.py: layers number all s
        view.shard_sequence(layout.tp)
    return (model, view, mine, tp), model_units(model)


def _stage_states(model, us: list, job: Job, layout: Layout) -> tuple:
    """(model states, dense units, expert units, quantised layers' shapes) of one stage's
    model."""
    us, experts = expert_units(model, layout.ep) if layout.ep > 1 else (us, [])
    quantised = [m.shape for _, m in quant_layers(model)]
    shards = mem.quantised_shards(layout)
    states = model_states(us, job, layout.dp, layout.zero, layout.offload, quantised, shards)
    if experts:  # this stage's experts, sharded over their own holders (parallel/expert.py)
        edp_job, edp = mem.expert_group(job, layout, layout.ep)
        more = model_states(experts, edp_job, edp.dp, edp.zero, edp.offload, None, shards)
        add_states(states, more)
    return states, us, experts, quantised


def _stage_forward(cfg: Config, derived, parts: tuple, s: int) -> tuple[int, list[int], int]:
    """Saved bytes of one micro-batch through a stage's fake model (`parts`: model, view,
    chunks, tp) at `s` tokens a sample: (the stage's input, its blocks chunk by chunk, what
    the last stage's norm, head and loss add)."""
    model, view, mine, tp = parts
    b = derived.micro_batch
    as_trained(model, cfg, derived, cfg.memory.recompute)
    meter = ActivationMeter(model)
    with meter.measure(), as_in_training():
        first, last = any(c.first for c in mine), any(c.last for c in mine)
        if first:
            h = view.embed_tokens(torch.zeros(b, s + 1, dtype=torch.long)[:, :-1])
        else:  # the received activations (sp: the tp rank's s/tp tokens), a leaf that
            # needs its gradient, as parallel/pipeline.py `_shape` sends them
            n = s // derived.tp if cfg.parallel.sp else s
            h = torch.zeros(b, n, derived.spec.dim, dtype=dev.dtype_of(cfg.precision.compute))
            h.requires_grad_(True)
        edge, blocks = meter.current, []
        for c in mine:
            before = meter.current
            for i in c.blocks:
                h = view.blocks[str(i)](h)
            blocks.append(meter.current - before)
        if last:
            logits = view.output(h)
            loss_sum(tp, logits, torch.zeros(b, s, dtype=torch.long))
        tail = meter.current - edge - sum(blocks)
    return edge, blocks, tail


def _cp_stage_bytes(whole: Job, asked: Layout, mine: list) -> tuple[float, float]:
    """(per micro-batch: what the cp kernels save in each of this stage's blocks beyond the
    fake forward's attention at s/cp, what its first stage's ids add) under `asked`'s cp."""
    if asked.cp == 1:
        return 0.0, 0.0
    per_layer = mem.cp_layer_saved_bytes(whole, asked) + repeated_kv_bytes(whole, asked, 1)
    # the rank's ids are a copy taken at its positions, not a view of a (b, s/cp + 1) window
    first = any(c.first for c in mine)
    return per_layer, -8.0 * asked.micro_batch if first else 0.0


def _moe_layers(view, chunk) -> int:
    """The blocks of `chunk` with routed experts."""
    return sum(holds_routed_experts(view.blocks[str(i)]) for i in chunk.blocks)


def _held_bytes(layout: Layout, job: Job, stage: int, edge: float, chunks: list, tail: float):
    """A stage's peak saved bytes from one micro-batch's: its input `edge`, each chunk's
    blocks (`chunks`), the last stage's `tail`, times the micro-batches its schedule keeps
    (interleaved: in the mix of chunks the engine's order holds at its peak)."""
    p, v, m = layout.pp, layout.pp_virtual, layout.micro_batches(job)
    if layout.pp_schedule == "interleaved" and p > 1:
        return interleaved_held(p, m, v, stage, chunks, edge, tail)
    held = act.in_flight(layout.pp_schedule, p, m, v, stage)
    one = mem.loss_one_at_a_time(layout, m)  # the last stage's loss and logits
    return (edge + sum(chunks)) * held + tail * (1.0 if one else held)


def _hf_stage(cfg: Config, derived, whole: Job, asked: Layout, stage: int) -> tuple:
    """(`mem_bytes`, dense ZeRO units, expert units, its fake model) of pipeline rank `stage` of
    a Hugging Face causal LM or our MoE decoder: its units' states (its own layers' experts
    apart), and one micro-batch's saved bytes from a fake forward of its chunk (embedding,
    layers, norm + head + loss as it holds them, at the rank's s/cp tokens) times the
    micro-batches its schedule keeps."""
    job, layout = as_data_parallel(whole, asked)  # cp > 1: dp x cp replicas at s/cp
    (model, view, mine, tp), us = _stage_model(cfg, derived, layout, stage)
    states, us, experts, quantised = _stage_states(model, us, job, layout)
    with FakeTensorMode():
        to_fake(model)
        ordered = in_forward_order(us, experts)
        states["buffers"] = zero_buffers(ordered, job, layout, tensor_bytes(model.buffers()))
        states["buffers"] += mem.quantised_transient(job, layout, stage, quantised)
        edge, chunks, tail = _stage_forward(cfg, derived, (model, view, mine, tp), job.seq_len)
    top_k = routed_spec(job.spec, model).top_k  # the exchange of each chunk's MoE layers
    exchange = exchange_saved_bytes(job, layout, top_k, 1)
    kernels, ids = _cp_stage_bytes(whole, asked, mine)  # (per layer, the first stage's ids)
    for k, c in enumerate(mine):
        chunks[k] += (exchange * _moe_layers(view, c) if exchange else 0) + kernels * len(c.blocks)
    states["activations"] = _held_bytes(layout, job, stage, edge + ids, chunks, tail)
    states["total"] = sum(v for k, v in states.items() if not k.startswith(("host_", "disk_")))
    return states, us, experts, model


def predict_stages(cfg: Config, derived, whole: Job, asked: Layout, model) -> dict:
    """The candidate record of a Hugging Face causal LM or MoE decoder in pipeline stages:
    every category at its busiest stage, stage 0's traffic (rank 0's, as metrics.jsonl's;
    `model`: the whole meta model); under cp, dp x cp replicas at s/cp plus the attention's
    exchange and kernels."""
    stages = [_hf_stage(cfg, derived, whole, asked, r) for r in range(asked.pp)]
    keys = list(stages[0][0])
    states = {k: max(s[0].get(k, 0) for s in stages) for k in keys}
    job, layout = as_data_parallel(whole, asked)
    _, dense, experts, first = stages[0]
    real = dataclasses.replace(job, frozen=tuple(dense))
    # tp and pp: what stage 0 runs (its blocks, the embedding; no head, loss or final norm)
    comm, calls = traffic.traffic(real, layout, 0), traffic.collective_calls(real, layout, 0)
    whole_moe_tp(comm, calls, job, layout, first)  # a transformers class's MoE MLPs under tp
    sliced_partial_tp(comm, calls, layout, first, align_of(job))  # ZeRO: rank 0's slices
    if layout.ep > 1:  # stage 0's experts over their holders; the busiest stage's exchange
        expert_traffic(comm, calls, job, layout, experts)
        moe_layers = max(len(s[2]) for s in stages)
        routed = dataclasses.replace(whole, spec=routed_spec(whole.spec, model))
        comm["ep"], calls["ep"] = traffic.ep_traffic(routed, asked, layers=moe_layers)
    if asked.cp > 1:  # the attention's exchange, from the sequence split itself
        kinds, calls["cp"] = traffic.cp_traffic(whole, asked)
        comm["cp"] = sum(kinds.values())
    return {
        **asked.record(),
        "mem_bytes": {k: int(v) for k, v in states.items()},
        "comm_bytes": comm,
        "comm_calls": calls,
    }
