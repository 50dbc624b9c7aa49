"""Memory per rank by category (the `mem_bytes` keys of docs/design.md), before launch.

A pipeline stage's ZeRO units (the formula's, or the real model's) priced as model states by
plan/states.py (the engine's padded flat buffers, exactly), activations saved for backward from
plan/activations.py's per-layer terms, and the transient buffers a step holds (plan/buffers.py).
The report is the max over ranks per category, as training/loop.py's metrics are.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from shardwise.finetune.quant_shards import split_dims, transient_bytes
from shardwise.plan import activations as act
from shardwise.plan import compression, moe, peers
from shardwise.plan.activations_hf import lora_unadapted_terms
from shardwise.plan.adapters import adapted_linears, block_quantised, finetune_units
from shardwise.plan.buffers import zero_transient
from shardwise.plan.layout import Job, Layout, as_data_parallel
from shardwise.plan.shapes import Unit, units
from shardwise.plan.stage_chunks import interleaved_bytes
from shardwise.plan.states import model_states

NF4_BYTES = 0.5 + (8 / 64 + 32 / (64 * 256)) / 8  # 4 bits + double-quantised constants (QLoRA)
# int8 (LLM.int8(), Dettmers et al. 2022): a byte per weight + an fp32 scale per row of 4096
INT8_BYTES = 1 + 4 / 4096
QUANT_BYTES = {"nf4": NF4_BYTES, "int8": INT8_BYTES}


def kept_in(mem_bytes: dict, where: str) -> float:
    """Bytes a prediction keeps off the device: in host memory (`host`: the `host_*`
    categories) or on local disk (`disk`: `disk_*`, NVMe offload)."""
    return sum(v for k, v in mem_bytes.items() if k.startswith(f"{where}_"))


def quantised_layers(job: Job, layout: Layout, stage: int = 0) -> list[tuple[int, int]]:
    """(out, in) of the whole quantised frozen linears of pipeline rank `stage`, which
    finetune/quant keeps outside the ZeRO units (split over `quantised_split`): the real
    model's where the job has them (pp = 1), else the LoRA targets of the stage's blocks (an
    MoE block's: its attention's, its router's and its shared experts', as quantise_base
    replaces every adapted nn.Linear's base)."""
    if not job.finetune.quantised:
        return []
    if job.quantised_shapes and layout.pp == 1:
        return list(job.quantised_shapes)
    layers = job_split(job, layout)[stage][0]
    ft, shapes = job.finetune, moe.lora_shapes(job.spec)
    if ft.lora_layers:  # targets naming some blocks only (pp = 1): block by block
        return [x for i, tags in enumerate(ft.lora_layers) for x in block_quantised(job, i, tags)]
    out = []
    for u in units(job.spec, 1, layers, first=False, last=False):
        out += adapted_linears(job.spec, shapes, u.entries, ft.lora_targets) * u.count
    return out


def quantised_split(layout: Layout) -> tuple[tuple[str, int], ...]:
    """The (mesh dim, ranks) each quantised weight is split over, as the engine splits it."""
    return split_dims(layout.dp, layout.tp, layout.zero)


def quantised_shards(layout: Layout) -> int:
    """Ranks each quantised weight is split over (the product of `quantised_split`)."""
    return math.prod(n for _, n in quantised_split(layout))


def quantised_transient(job: Job, layout: Layout, stage: int = 0, shapes=None) -> float:
    """One quantised linear gathered and dequantised to compute dtype at a time; `shapes`:
    the (out, in) of the stage's quantised linears (default: `quantised_layers`)."""
    split = [n for _, n in quantised_split(layout)]
    kind = job.finetune.base_quant
    shapes = quantised_layers(job, layout, stage) if shapes is None else shapes
    return max((transient_bytes(a, b, split, job.bc, kind) for a, b in shapes), default=0)


@lru_cache(maxsize=4096)
def stage_split(
    spec, p: int, v: int, seq_len: int, split: str = ""
) -> tuple[tuple[int, bool, bool], ...]:
    """(blocks, holds the embedding, holds the head) per pipeline rank. The engine's cut
    (parallel/pipeline_split.plan_chunks: `split` when given, else chunks balanced by
    parameters and FLOPs; rank r holding chunks r, r+p, ...) when it is there; else blocks
    split evenly."""
    if p == 1:
        return ((spec.n_layers, True, True),)
    try:
        from shardwise.parallel.pipeline_split import plan_chunks
    except ImportError:  # before pipeline parallelism is in the engine
        chunks = None
    else:
        chunks = plan_chunks(spec, p, v, split, seq_len)
    if chunks is None:
        return tuple(
            (spec.n_layers // p + (1 if r < spec.n_layers % p else 0), r == 0, r == p - 1)
            for r in range(p)
        )
    return tuple(
        (
            sum(len(c.blocks) for c in chunks if c.index % p == r),
            any(c.first for c in chunks if c.index % p == r),
            any(c.last for c in chunks if c.index % p == r),
        )
        for r in range(p)
    )


def job_split(job: Job, layout: Layout) -> tuple[tuple[int, bool, bool], ...]:
    """`stage_split` of this job and layout (its configured `pp_split` included)."""
    return stage_split(job.spec, layout.pp, layout.pp_virtual, job.seq_len, job.pp_split)


def stage_ranks(job: Job, layout: Layout) -> list[int]:
    """The pipeline ranks whose memory can be the largest: first, last, most blocks (and the
    second, which keeps two hidden states per micro-batch in flight where the engine keeps
    what a stage received and sent: `peers.Deviations.pp_stage_copies`)."""
    split = job_split(job, layout)
    most = max(range(len(split)), key=lambda r: split[r][0])
    second = {1} if peers.of(job).pp_stage_copies and layout.pp > 2 else set()
    return sorted({0, layout.pp - 1, most} | second)


def stage_units(job: Job, layout: Layout, stage: int) -> list[Unit]:
    """The ZeRO units of pipeline rank `stage`."""
    if job.frozen is not None:  # the real model's units (explain with train.freeze)
        return moe.split_units(job.frozen, job.spec, layout.ep)[0]  # ep: without experts
    layers, first, last = job_split(job, layout)[stage]
    us = units(job.spec, layout.tp, layers, first=first, last=last)
    ft = job.finetune
    us = finetune_units(us, job, layout.tp) if ft.lora or ft.quantised else us
    return moe.split_units(us, job.spec, layout.ep)[0]  # ep > 1: the experts' units apart


def loss_one_at_a_time(layout: Layout, m: int) -> bool:
    """Does the last pipeline stage hold one micro-batch's logits and loss at a time? 1F1B and
    interleaved run each micro-batch's backward right after its forward there, but interleaved
    with m = p micro-batches runs every forward first (no steady state, `act.in_flight`), as
    GPipe does; zero bubble keeps them, with the rest of the micro-batch, until its weight
    pass."""
    return layout.pp_schedule == "1f1b" or (layout.pp_schedule == "interleaved" and m != layout.pp)


def activation_bytes(job: Job, layout: Layout, stage: int) -> float:
    """Peak bytes saved for backward on one rank of pipeline stage `stage`."""
    spec, s, b, c, t = job.spec, job.seq_len, layout.micro_batch, job.bc, layout.tp
    if job.act_lines:  # a real model measured at 1 and 2 samples (job/real.py; tp = pp = 1)
        a0, a1 = dict(job.act_lines)[layout.recompute]
        return a0 + a1 * b
    p, ft = layout.pp, job.finetune
    layers, first, last = job_split(job, layout)[stage]
    if ft.lora_layers:  # targets naming some blocks only (pp = 1: this stage holds all)
        blocks, first_adapted = _adapted_blocks(job, layout)
        targets = ft.lora_layers[first_adapted] if first_adapted < len(ft.lora_layers) else ()
    else:  # every block alike; the first adapted block is the first
        blocks, targets = _layer_bytes(job, layout, ft.lora_targets) * layers, ft.lora_targets
        first_adapted = 0
    m = layout.micro_batches(job)
    held = act.in_flight(layout.pp_schedule, p, m, layout.pp_virtual, stage)
    fused = peers.of(job).fused_loss
    edges = act.edge_terms(spec, s, b, c, first, last, t, job.packed, fused, job.loss_chunks)
    selective = layout.recompute == "selective"  # (for the first block's terms among them)
    if ft.lora:  # the frozen head and final norm; the first block's input needs no gradient
        edges = act.lora_terms(edges, spec, s, b, c, (), ft.lora_rank, False)
        if first and layout.recompute != "full":  # (what it leaves out: per block family)
            drop, alone = bool(ft.lora_dropout), last and first_adapted == layers - 1
            edges += act.lora_first_block(
                spec, s, b, targets, drop, c, job.packed, alone, selective
            )
    edge = act.layer_bytes(edges, t, layout.sp, selective)
    held_edge = 1.0 if (last and p > 1 and loss_one_at_a_time(layout, m)) else held
    copies = 0.0
    if peers.of(job).pp_stage_copies and p > 1:  # received and sent hidden states (peers)
        kept = (0 if first else 1) + (0 if last else 1)
        copies = kept * act.full_recompute_bytes(spec, s, b, c, t, layout.sp) * held
    if layout.pp_schedule == "interleaved" and p > 1:  # which chunks the peak holds
        return interleaved_bytes(job, layout, stage, blocks / layers, edge) + copies
    return blocks * held + edge * held_edge + copies


def _layer_bytes(job: Job, layout: Layout, targets: tuple[str, ...]) -> float:
    """Bytes one block saves for backward on one rank, with LoRA on `targets`."""
    spec, s, b, c, t = job.spec, job.seq_len, layout.micro_batch, job.bc, layout.tp
    ft = job.finetune
    if layout.recompute == "full":
        return act.full_recompute_bytes(spec, s, b, c, t, layout.sp)
    if layout.recompute == "selective" and peers.of(job).selective_ops:
        return act.layer_bytes(act.op_sac_terms(spec, s, b, c), t, layout.sp)
    terms, selective = _block_terms(job, b), layout.recompute == "selective"
    if ft.lora:  # the base frozen, the adapters' own saved tensors
        drop = bool(ft.lora_dropout)
        terms = act.lora_terms(terms, spec, s, b, c, targets, ft.lora_rank, drop, selective)
    return act.layer_bytes(terms, t, layout.sp, selective)


def _adapted_blocks(job: Job, layout: Layout) -> tuple[float, int]:
    """(bytes all blocks save, the first adapted block) when LoRA adapts some blocks only:
    each block by its own targets; without full recomputation the blocks before the first
    adapted one save nothing (no input, weight or adapter there needs a gradient) but, under
    selective recomputation, their recomputed regions' inputs."""
    layers = job.finetune.lora_layers
    first_adapted = next((i for i, tags in enumerate(layers) if tags), len(layers))
    first_adapted = 0 if layout.recompute == "full" else first_adapted
    unadapted = lora_unadapted_terms(_block_terms(job, layout.micro_batch))
    before = act.layer_bytes(unadapted, layout.tp, layout.sp, layout.recompute == "selective")
    after = sum(_layer_bytes(job, layout, tags) for tags in layers[first_adapted:])
    return before * first_adapted + after, first_adapted


def _block_terms(job: Job, b: int) -> tuple:
    peer = peers.of(job)
    if peer.block_memory == "paper":  # another framework's 16-bit block
        return act.paper_block_terms(job.spec, job.seq_len, b, peer.unfused_attention)
    return act.block_terms(job.spec, job.seq_len, b, job.bc, job.packed)


def backward_transient(job: Job, layout: Layout) -> float:
    """Temporaries beyond the saved activations during backward (not in `total`, but in the
    fit check): the logits' gradient (fp32 + compute copy) and, under recomputation, one
    layer's recomputed activations."""
    spec, s, b, c, t = job.spec, job.seq_len, layout.micro_batch, job.bc, layout.tp
    # (a fused loss writes the gradient over the logits it keeps: nothing new; an upcast
    # loss holds two fp32 gradients of the logits while log-softmax's backward runs)
    peer = peers.of(job)
    per_logit = 0.0 if peer.fused_loss else 8.0 if peer.loss_upcast else 4.0 + c
    tokens = s * b if job.loss_chunks <= 1 else -(-s * b // job.loss_chunks)  # one chunk's
    logits = per_logit * tokens * spec.vocab_size / t
    terms = _block_terms(job, b)
    layer = act.layer_bytes(terms, t, layout.sp) if layout.recompute != "none" else 0.0
    return max(logits, layer)


def _cp_shape(job: Job, layout: Layout):
    """(spec, micro-batch b, local length s/cp, e = b·(H/tp)·(s/cp)·head_dim): the sizes both
    cp terms below are made of (k/v heads repeated to H; a tp rank holds H/tp of them)."""
    spec, b = job.spec, layout.micro_batch
    local = job.seq_len // layout.cp
    return spec, b, local, b * (spec.n_heads // layout.tp) * local * spec.head_dim


def cp_saved_bytes(job: Job, layout: Layout) -> float:
    """What a cp rank saves for backward beyond its data-parallel equivalent at seq_len / cp
    (`as_data_parallel`), from the kernels of parallel/context_comm.py; 0 at cp = 1.

    Per layer, with e = b·H·(s/cp)·head_dim elements (k/v heads repeated to H): plain SDPA's
    output is the wo input (a [B, S, H, D] layout), the kernels' is not, so their output is
    saved apart: the ring's merged output in fp32 (4e; its log-sum-exp [B, H, S/cp] in fp32,
    as SDPA's); Ulysses' SDPA output in fp32 (4e) over q/k/v cast to fp32 (3(4 - c)e beyond
    the compute-dtype q/k/v plain SDPA keeps) and its two int64 reorderings of the whole
    sequence; with packed rows also the records' mask of the whole sequence that SDPA gets
    ([B, 1, S, S], as fp32 like q). A recomputed core or block keeps only its inputs: nothing
    more. Outside the blocks: the rank's token ids and targets are copies taken at its
    positions (8·b·s/cp each), not views of one (b, s/cp + 1) window; packed rows (models/
    packing.py) are no window, and a rank's part of them builds no additive mask [b, 1, s/cp,
    s/cp] (the kernels mask by record themselves), which the equivalent holds once."""
    if layout.cp == 1:
        return 0.0
    spec, b, local, _ = _cp_shape(job, layout)
    if job.packed:
        edge = -job.bc * b * local * local
    elif layout.tp > 1:  # vocab-parallel: the saved ids and targets are the rank's own copies
        edge = 0
    else:  # the formula's ids are the (b, s+1) window, its flattened targets a copy of it for
        # b > 1 and the window itself for one sample
        edge = -8 * b + (8 * local if b == 1 and job.loss_chunks <= 1 else 0)
    layers = -(-spec.n_layers // layout.pp)  # the largest stage's
    return cp_layer_saved_bytes(job, layout) * layers + edge


def cp_layer_saved_bytes(job: Job, layout: Layout) -> float:
    """`cp_saved_bytes` of one layer (the kernels' own), without what is saved outside the
    blocks; 0 at cp = 1."""
    if layout.cp == 1 or layout.recompute != "none":
        return 0.0
    _, _, _, e = _cp_shape(job, layout)
    per_layer = 4 * e
    if layout.cp_mode == "ulysses":
        per_layer += 3 * (4 - job.bc) * e + 2 * 8 * job.seq_len
        if job.packed:  # the records' mask of the whole sequence, as SDPA converts it
            per_layer += 4 * layout.micro_batch * job.seq_len * job.seq_len
    return per_layer


def cp_transient(job: Job, layout: Layout) -> float:
    """The ring's buffers during one layer's attention backward (not saved, so not in
    `total`; in the fit check as `backward_transient`): the K/V block in hand and the one
    arriving (2·2e in the compute dtype), dQ and the output gradient in fp32, the dK/dV sum,
    the block's dK/dV being sent and the one arriving (3·2e in fp32), and one block pair's
    scores, probabilities and their gradient (3·b·H·(s/cp)² in fp32) where the blocks are
    computed explicitly: packed rows, or a device without a fused kernel for them (a GPU:
    device.attention_with_lse; the CPU's flash kernel keeps them on chip). Ulysses: the stacked
    q/k/v going out and coming in (2·3e in the compute dtype). 0 at cp = 1."""
    if layout.cp == 1:
        return 0.0
    spec, b, local, e = _cp_shape(job, layout)
    c = job.bc
    if layout.cp_mode == "ulysses":
        return 2 * 3 * e * c
    heads = spec.n_heads // layout.tp
    fused = peers.of(job).cp_fused_blocks or not (job.packed or job.hardware.kernel_model)
    scores = 0 if fused else 3 * 4 * b * heads * local * local
    return 2 * 2 * e * c + 2 * 4 * e + 3 * 2 * 4 * e + scores


def _trainable(units) -> int:
    return sum(u.count * sum(e[0] for e in u.entries if e[1]) for u in units)


def _stage_states(job: Job, layout: Layout, st: int) -> tuple[list, dict[str, float]]:
    """A pipeline stage's ZeRO units and its ranks' model states (params, grads, master,
    optimizer and their host/disk parts)."""
    us = stage_units(job, layout, st)
    quantised = quantised_layers(job, layout, st)
    shards = quantised_shards(layout)
    mem = model_states(us, job, layout.dp, layout.zero, layout.offload, quantised, shards)
    if peers.of(job).fp32_grads:  # not sharded over dp
        mem["grads"] += 4 * _trainable(us)
    return us, mem


def step_peak(job: Job, layout: Layout) -> float:
    """Device bytes at the optimizer step of an engine that copies gradients there
    (`peers.Deviations.step_grad_copies`), the worst stage; 0 for one that does not. DeepSpeed
    frees the 16-bit gradients of the parameters other ranks update, then flattens its own share
    into a new 16-bit buffer and casts that to a new fp32 one: its share three times (2 + 2 + 4
    bytes an element in bf16/fp16) beside the other model states; the activations are gone by
    then."""
    if not peers.of(job).step_grad_copies:
        return 0.0
    worst = 0.0
    for st in stage_ranks(job, layout):
        us, mem = _stage_states(job, layout, st)
        states = sum(v for k, v in mem.items() if not k.startswith(("host_", "disk_", "grads")))
        kept = job.bc * _trainable(us) / (layout.dp if layout.zero >= 1 else 1)
        worst = max(worst, states + kept + step_copies(job, layout, us))
    return worst


def step_copies(job: Job, layout: Layout, units: list) -> float:
    """What `peers.Deviations.step_grad_copies` allocates at the step on a rank holding
    `units`: its share of their gradients (1/dp under ZeRO-1/2) flattened, then cast to fp32.
    DeepSpeed of 2021-22 (BLOOM's) kept every param group's fp32 copy until one optimizer step;
    since it steps group by group, freeing each group's copies first, the peak is its largest
    group (the matrices': less by the norm weights and biases, ~0.1 % of a transformer)."""
    return (job.bc + 4) * _trainable(units) / (layout.dp if layout.zero >= 1 else 1)


def communicator_bytes(job: Job, layout: Layout) -> float:
    """Device bytes of the NCCL communicators a rank uses (`Hardware.comm_buffer_bytes`): the
    world's (metrics, checks), one per parallel dimension of more than one rank, the pipeline's
    (or, `peers.Deviations.pp_pairs`, a pair per neighbouring stage: two in the middle, the first
    stage's neighbour and its tied-embedding pair), and the framework's own
    (`peers.Deviations.extra_groups`)."""
    hw = job.hardware
    if job.devices == 1:
        return 0.0
    e = peers.of(job)
    groups, pairs = 1 + (layout.dp > 1) + (layout.tp > 1), 0
    if layout.pp > 1:
        groups += e.extra_groups + (not e.pp_pairs)
        pairs = min(2, (layout.pp - 1) * e.pp_pairs + e.extra_pairs)
    return groups * hw.comm_buffer_bytes + pairs * hw.pair_buffer_bytes


def device_overhead(job: Job, layout: Layout) -> float:
    """What a rank's device holds beyond the tensors `predict_memory` counts: the hardware's
    reserve (CUDA context, workspaces, fragmentation) and NCCL's communicators."""
    job, layout = as_data_parallel(job, layout)  # (a cp group's communicator: not priced)
    return job.hardware.reserve + communicator_bytes(job, layout)


def predict_memory(job: Job, layout: Layout) -> dict[str, float]:
    """`mem_bytes` per rank: max over ranks per category, `total` the largest rank's sum."""
    stages = stage_ranks(job, layout)
    per_stage = []
    for st in stages:
        us, mem = _stage_states(job, layout, st)
        wire = compression.zero_wire_copy(layout)
        _, first, last = job_split(job, layout)[st]
        tied = job.spec.tie_embeddings and first and last  # the head re-gathers the embedding
        mem["buffers"] = zero_transient(us, job, layout.dp, layout.zero, wire, tied)
        mem["buffers"] += compression.state_bytes(job, layout, us)
        mem["buffers"] += quantised_transient(job, layout, st) + job.buffer_bytes
        mem["activations"] = activation_bytes(job, layout, st)
        mem["total"] = sum(v for k, v in mem.items() if not k.startswith(("host_", "disk_")))
        per_stage.append(mem)
    keys = list(per_stage[0]) + [k for m in per_stage[1:] for k in m if k not in per_stage[0]]
    return {k: max(m.get(k, 0.0) for m in per_stage) for k in keys}


def expert_group(job: Job, layout: Layout, ep: int) -> tuple[Job, Layout]:
    """The job and layout that expert parallelism's expert units (parallel/expert.py) are
    sharded and reduced in: the (dp / ep)·tp ranks holding the same experts (an MoE layer is
    whole on every tp rank, each routing its sequence shard), each with the same micro-batches
    as before; no tied embedding among those units."""
    spec = dataclasses.replace(job.spec, tie_embeddings=False) if job.spec else None
    edp = layout.dp // ep * layout.tp
    shrunk = dataclasses.replace(job, spec=spec, global_batch=job.global_batch // ep * layout.tp)
    return shrunk, dataclasses.replace(layout, dp=edp, ep=1, tp=1, sp=False)
