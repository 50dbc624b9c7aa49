"""The planner's prediction of a real model without a formula (Hugging Face definitions, image
models, your own module, our MoE decoder's units) in one pipeline stage: model states from
its ZeRO units, activations from one fake forward (job/fake.py) plus what the cp kernels save,
traffic from the units and the layout."""

from __future__ import annotations

import dataclasses

from shardwise.job.experts import in_forward_order, partial_in_slice, routed_spec, whole_moe_tp
from shardwise.plan import compression, moe, traffic
from shardwise.plan import memory as mem
from shardwise.plan.activations_hf import repeated_heads
from shardwise.plan.buffers import align_of, zero_transient
from shardwise.plan.layout import Job, Layout, as_data_parallel
from shardwise.plan.search import evaluate
from shardwise.plan.shapes import Unit
from shardwise.plan.states import add_states, model_states

TIME_KEYS = ("step_time_s", "tokens_per_s", "mfu", "mfu_causal", "hfu", "flop_convention", "time")


def zero_buffers(us: list, job: Job, layout: Layout, module_buffers: int) -> float:
    """`buffers` of a real model: ZeRO's transient units and gradient buffers (a tied head,
    `job.spec.tie_embeddings`, re-gathers the first unit), compression state, and the
    module's own buffers."""
    wire = compression.zero_wire_copy(layout)
    tied = job.spec.tie_embeddings
    # ZeRO-3 gathers a root's expert unit with its dense one (both hook the block) and
    # prefetches the previous root's last unit; ZeRO-2 only has gradients in flight, unit by
    # unit (parallel/zero.py), so there the expert unit counts as a root of its own
    together = ("[frozen]", "[experts]") if layout.zero == 3 else ("[frozen]",)
    return (
        zero_transient(us, job, layout.dp, layout.zero, wire, tied, together)
        + compression.state_bytes(job, layout, us)
        + module_buffers
    )


def expert_traffic(comm: dict, calls: dict, job: Job, layout: Layout, experts: list) -> None:
    """Add the expert units' gradient reduction (and ZeRO gathers) over the (dp / ep)·tp ranks
    holding the same experts to `comm`/`calls`' dp entries, where comm.py counts them."""
    edp_job, edp = mem.expert_group(job, layout, layout.ep)
    held = dataclasses.replace(edp_job, frozen=tuple(experts))
    comm["dp"] += traffic.traffic(held, edp)["dp"]
    calls["dp"] += traffic.collective_calls(held, edp)["dp"]


def sliced_partial_tp(comm: dict, calls: dict, layout: Layout, model, align: int) -> None:
    """Take out of `comm`/`calls`' tp entries (which price the whole partial all-reduce over
    tp) the partial gradients outside rank 0's ZeRO slices (`partial_in_slice`): 2·(t−1)/t
    fp32 bytes an element; no call at all when its slices hold none."""
    if layout.tp == 1 or layout.zero == 0:
        return
    inside, total = partial_in_slice(model, layout, align)
    comm["tp"] -= 2 * traffic.ring_share(layout.tp) * (total - inside) * 4
    if total and not inside:  # reduce_partial returns at once on an empty list
        calls["tp"] -= 1


def repeated_kv_bytes(job: Job, layout: Layout, layers: int | None = None) -> float:
    """What transformers' attention through the cp kernels saves beyond its own SDPA: SDPA
    attends to k/v at their KV heads (`enable_gqa` for head dims up to 256, transformers'
    sdpa_attention `use_gqa_in_sdpa`), the kernels keep them repeated to the rank's query
    heads (context_hf.py): 2·(H/tp − KV/tp)·b·(s/cp)·head_dim more elements a layer
    (activations_hf.repeated_heads), in the compute dtype, in `layers` of them (default:
    all). A recomputed block keeps only its input. 0 at
    cp = 1, and for packed rows: their explicit mask turns SDPA's GQA off (`use_gqa_in_sdpa`),
    so the fake forward keeps the repeated k/v already."""
    spec = job.spec
    gqa_sdpa = spec.n_kv_heads < spec.n_heads and spec.head_dim <= 256 and not job.packed
    if layout.cp == 1 or layout.recompute != "none" or not gqa_sdpa:
        return 0.0
    local = job.seq_len // layout.cp
    extra = 2 * repeated_heads(spec, layout.tp) * layout.micro_batch * local * spec.head_dim
    return extra * job.bc * (spec.n_layers if layers is None else layers)


def exchange_saved_bytes(job: Job, layout: Layout, top_k: int, moe_layers: int) -> float:
    """What expert parallelism's token exchange saves for backward beyond the experts of one
    process (parallel/expert_comm.ExpertExchange): the received rows' arrival order and its
    inverse, two int64 indices a row, in every MoE layer. Assumes balanced, dropless routing,
    as traffic.ep_traffic does: a rank receives as many rows as it sends, top_k for each of
    its b·s/(cp·tp) tokens. The rows, and with them the experts' own saved bytes, follow the
    routing, so the measured peak (max over ranks) is above this by the step's imbalance. A
    fully recomputed block keeps only its input. 0 at ep = 1."""
    if layout.ep == 1 or layout.recompute == "full":
        return 0.0
    tokens = layout.micro_batch * job.seq_len // layout.cp // (layout.tp if layout.sp else 1)
    return 2 * 8 * tokens * top_k * moe_layers


def _moe_time(job: Job, layout: Layout, us: list[Unit]) -> dict:
    """The step time of an MoE decoder's layout, as `plan` prices it (plan/moe.py: its blocks
    kernel by kernel, the exposed all-to-all under ep, MFU of the active parameters), from
    the real model's units; the model states and traffic stay the measured ones."""
    rec = evaluate(dataclasses.replace(job, frozen=tuple(us)), layout)
    return {k: rec[k] for k in TIME_KEYS}


def _states(dense, experts, job, layout, asked, module_buffers, quantised) -> tuple[dict, dict]:
    """(`mem_bytes` of the model states and buffers, of which the expert units') over the
    dp x cp replicas `layout` (as_data_parallel) of the `asked` layout."""
    # a quantised base is split over tp (and dp under ZeRO-3) as the engine splits it
    shards = mem.quantised_shards(layout)
    states = model_states(dense, job, layout.dp, layout.zero, layout.offload, None, shards)
    edp_job, edp = mem.expert_group(job, layout, asked.ep)  # (ep = 1: no expert units)
    more = {}
    if experts:
        more = model_states(experts, edp_job, edp.dp, edp.zero, edp.offload, None, shards)
        add_states(states, more)
    states["buffers"] = zero_buffers(in_forward_order(dense, experts), job, layout, module_buffers)
    states["buffers"] += mem.quantised_transient(job, layout) if quantised else 0
    return states, more


def predict_measured(
    whole: Job, asked: Layout, model, units: tuple, activations: int, module_buffers: int
) -> dict:
    """The candidate record of a real model without a formula in one stage: states + the fake
    forward's `activations` (unsharded models only); `units`: (all, dense, expert units)."""
    us, dense, experts = units
    # cp > 1: dp x cp replicas at seq_len / cp, as `evaluate` prices our decoders
    job, layout = as_data_parallel(whole, asked)
    quantised = bool(whole.quantised_shapes)
    states, more = _states(dense, experts, job, layout, asked, module_buffers, quantised)
    # what transformers' attention through the cp kernels saves beyond the fake forward's
    # SDPA (parallel/context_hf.py: the same kernels as our decoders')
    states["activations"] = activations + mem.cp_saved_bytes(whole, asked)
    states["activations"] += repeated_kv_bytes(whole, asked)
    if whole.packed and asked.cp > 1 and asked.recompute == "full":
        # cp_saved_bytes takes off the records' mask the equivalent's formula prices; the
        # fake forward's fully recomputed blocks saved none (only SDPA inside them does)
        states["activations"] += whole.bc * asked.micro_batch * (whole.seq_len // asked.cp) ** 2
    routed = dataclasses.replace(whole, spec=routed_spec(whole.spec, model))
    states["activations"] += exchange_saved_bytes(whole, asked, routed.spec.top_k, len(experts))
    states["total"] = sum(v for k, v in states.items() if not k.startswith(("host_", "disk_")))
    # data-parallel traffic and calls from the real units (of tp rank 0's shard)
    real = dataclasses.replace(job, frozen=tuple(dense))
    comm, calls = traffic.traffic(real, layout), traffic.collective_calls(real, layout)
    whole_moe_tp(comm, calls, job, layout, model)  # a transformers class's MoE MLPs under tp
    sliced_partial_tp(comm, calls, layout, model, align_of(job))
    if experts:  # the expert units' reduction over their holders, counted under dp
        expert_traffic(comm, calls, job, layout, experts)
    if asked.ep > 1:  # the token exchange, at balanced routing (traffic.ep_traffic)
        comm["ep"], calls["ep"] = traffic.ep_traffic(routed, asked)
    if asked.cp > 1:  # the attention's exchange, from the sequence split itself
        kinds, calls["cp"] = traffic.cp_traffic(whole, asked)
        comm["cp"] = sum(kinds.values())
    out = {
        **asked.record(),
        "mem_bytes": {k: int(v) for k, v in states.items()},
        "comm_bytes": comm,
        "comm_calls": calls,
    }
    if more:  # of which the expert units (parallel.ep), per rank
        out["expert_mem_bytes"] = {k: int(v) for k, v in more.items() if v}
    if moe.is_moe(whole.spec):  # our MoE decoder: its step time (plan/moe.py)
        out.update(_moe_time(whole, asked, us))
    return out
