"""Step time per rank: compute, pipeline bubble, tensor/pipeline/data-parallel communication
(with the part hidden behind backward), optimizer step and offload transfers.

Traffic is counted as comm.py counts it (ring-equivalent bytes sent per rank, DESIGN.md), so
predicted and measured `comm_bytes` compare key by key; a collective's time is those bytes
over the link's bandwidth (ring all-reduce: Patarasuk & Yuan 2009) plus a fixed latency per
call (the alpha-beta model, Hockney 1994), with calls counted as comm.py counts them too.
"""

from __future__ import annotations

from shardwise.finetune.quant import gather_steps
from shardwise.plan import activations as act
from shardwise.plan import compression, gpu, kernels
from shardwise.plan import memory as mem
from shardwise.plan.buffers import align_of, padded_numel
from shardwise.plan.compression import bucket_calls, sent_bytes, wire_bytes
from shardwise.plan.layout import Job, Layout
from shardwise.plan.shapes import linear_shapes, non_embedding_params

# bytes per element of one fused AdamW step: reads param, grad, 2 moments (fp32), writes 3
ADAM_BYTES = 28


# what `mfu` and `hfu` count, so figures compare like-for-like with a paper's convention
FLOP_CONVENTION = (
    "MFU: model FLOPs per token 6N + 12·L·h·s (PaLM, Chowdhery et al. 2022, app. B; N the "
    "non-embedding parameters, a tied head counted; attention's QK^T and AV over the whole "
    "s x s square, not halved for causal masking; LoRA: 4N). mfu_causal: the same with the "
    "attention term halved (6N + 6·L·h·s: the score blocks a causal kernel computes). HFU: "
    "the FLOPs executed, recomputation included (full: + 2N + 4·L·h·s, selective: + 4·L·h·s)."
)


def model_flops_per_token(job: Job, causal: bool = False) -> float:
    """6N + 12·L·h·s (PaLM, Chowdhery et al. 2022, app. B): the MFU numerator; `causal`
    halves the attention term (6·L·h·s). With LoRA the frozen weights need no weight
    gradient: 4N (adapters are negligible)."""
    spec = job.spec
    n = (job.matmul_params or non_embedding_params(spec)) * (4.0 if job.finetune.lora else 6.0)
    return n + (6.0 if causal else 12.0) * spec.n_layers * spec.dim * job.seq_len


def hardware_flops_per_token(job: Job, layout: Layout) -> float:
    """FLOPs actually executed: recomputation repeats the forward (2N + 4Lhs: Korthikanti
    et al. 2022 §5) or only attention (4Lhs, selective); LoRA skips the frozen weights'
    gradient (2N of the 6N) but adds its adapters."""
    spec, s = job.spec, job.seq_len
    n = job.matmul_params or non_embedding_params(spec)
    attn = 12.0 * spec.n_layers * spec.dim * s
    flops = 6.0 * n + attn
    if job.finetune.lora:
        flops -= 2.0 * n
    if layout.recompute == "full":
        flops += 2.0 * n + attn / 3
    elif layout.recompute == "selective" and job.engine.selective_ops:
        # every second matmul again (activations.op_sac_terms): 2 FLOPs per weight
        again = sum(k * n for _, k, n, _ in act.linears(spec)[1::2])
        flops += 2.0 * spec.n_layers * again
    elif layout.recompute == "selective":
        flops += attn / 3
    return flops


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def traffic(job: Job, layout: Layout) -> dict[str, float]:
    """Ring-equivalent bytes sent per rank per step over dp, tp and pp."""
    return traffic_totals(traffic_by_kind(job, layout))


def traffic_totals(by_kind: dict[str, dict[str, float]]) -> dict[str, float]:
    """`traffic_by_kind` summed over the kinds of each mesh dimension."""
    return {dim: sum(kinds.values()) for dim, kinds in by_kind.items()}


def traffic_by_kind(job: Job, layout: Layout) -> dict[str, dict[str, float]]:
    """`traffic` split by collective kind (all_reduce, reduce_scatter, all_gather, send) per
    mesh dimension: the kinds cost differently per byte on some transports (gloo)."""
    spec, s, b = job.spec, job.seq_len, layout.micro_batch
    m, dp, t, p, v = layout.micro_batches(job), layout.dp, layout.tp, layout.pp, layout.pp_virtual
    us, align = mem.stage_units(job, layout, 0), align_of(job)
    padded = sum(padded_numel(u, dp, align) * u.count for u in us)
    # frozen units (their own, parallel/zero.py) are neither reduced nor re-published
    reduced = sum(padded_numel(u, dp, align) * u.count for u in us if any(e[1] for e in u.entries))
    bc, ring = job.bc, _ring(dp)
    # ZeRO-0: one all-reduce of every gradient per step; ZeRO-1: a reduce-scatter once and an
    # all-gather of the updated slices; ZeRO-2: reduce-scatter every micro-batch; ZeRO-3: and
    # a gather before forward and before backward
    scatters = {0: 0, 1: 1, 2: m, 3: m}[layout.zero]
    gathers = {0: 0, 1: 1, 2: 1, 3: 2 * m}[layout.zero]
    dp_kinds = {
        "all_reduce": 2 * ring * sent_bytes(job, layout, us) if layout.zero == 0 else 0.0,
        "reduce_scatter": ring * reduced * wire_bytes(job, layout) * scatters,
        "all_gather": ring * (padded if layout.zero == 3 else reduced) * bc * gathers,
    }
    if layout.zero == 3:  # frozen units before the first trainable one: backward does not
        # reach them (nothing before them needs a gradient), so no gather for it
        lead = sum(padded_numel(u, dp, align) * u.count for u in _leading_frozen(us))
        dp_kinds["all_gather"] -= ring * lead * bc * m
    if layout.zero == 3 and spec.tie_embeddings and p == 1:
        # the tied head is a second root of the embedding's unit: it is gathered again for
        # the head's forward (it was freed after the embedding's), once per micro-batch
        dp_kinds["all_gather"] += ring * -(-us[0].numel // dp) * dp * bc * m
    quantised = _quant_uses(job, layout)  # finetune/quant: a split base gathered per use
    if quantised["dp"]:
        dp_kinds["all_gather"] += ring * m * sum(quantised["dp"])
    act = b * s * spec.dim * bc
    layers = -(-spec.n_layers // p)
    # parallel/tensor.py, per micro-batch: per layer 2 all-reduces forward and 2 backward
    # (sp: all-gather + reduce-scatter pairs, the same bytes); embedding and head: 2 more;
    # the vocabulary-parallel loss all-reduces 3 fp32 values per token. Full recomputation
    # repeats a block's forward up to its last saved tensor: 1 all-reduce (sp: 3 halves); the
    # whole forward, 2 (sp: 4 halves), where the engine recomputes whole blocks
    redo = 4 if job.engine.recompute_whole_block else (3 if layout.sp else 2)
    per_mb = 2 * (4 * layers + 2) + redo * layers * (layout.recompute == "full")
    blocks = _ring(t) * m * act * per_mb
    tp_kinds = {"all_reduce": _ring(t) * m * 4 * 6 * b * s}
    if layout.sp:
        tp_kinds["all_gather"] = tp_kinds["reduce_scatter"] = blocks / 2
        tp_kinds["all_gather"] += _ring(t) * m * act * _regathers(job, layout) * layers
    else:
        tp_kinds["all_reduce"] += blocks
    if _skips_first_entry(job):  # its backward: a reduce-scatter (sp) or an all-reduce
        kind = "reduce_scatter" if layout.sp else "all_reduce"
        tp_kinds[kind] -= _ring(t) * m * act * (1 if layout.sp else 2)
    if t > 1:  # gradients of parameters replicated over tp ranks that each saw part of them,
        # summed in fp32 (the optimizer's master gradients) once per step
        tp_kinds["all_reduce"] += 2 * _ring(t) * _tp_partial(job, t, layout.sp) * 4
    if quantised["tp"]:
        tp_kinds["all_gather"] = tp_kinds.get("all_gather", 0.0)
        tp_kinds["all_gather"] += _ring(t) * m * sum(quantised["tp"])
    pp_bytes = 0.0
    if p > 1:  # activations forward and their gradients backward, per micro-batch and chunk:
        # a rank sends forward from its v chunks (the last chunk's rank one fewer) and backward
        # likewise (the first chunk's rank one fewer); with p = 2 each rank is one of those
        split = layout.sp or job.engine.pp_scatter_gather
        pp_bytes = m * act / (t if split else 1) * (2 * v - (1 if p == 2 else 0))
    return {"dp": dp_kinds, "tp": tp_kinds, "pp": {"send": pp_bytes}}


def _leading_frozen(us: list) -> list:
    """The units, in forward order, before the first one with a trainable parameter."""
    out = []
    for u in us:
        if any(e[1] for e in u.entries):
            break
        out.append(u)
    return out


def _quant_uses(job: Job, layout: Layout) -> dict[str, list[int]]:
    """Per mesh dimension, the bytes of each all-gather of a split quantised linear per
    micro-batch (finetune/quant: over tp, then dp): per use, and a linear is used for its
    forward, a fully recomputed forward, and backward where its input needs a gradient."""
    split = mem.quantised_split(layout)
    sizes, dims = [n for _, n in split], [d for d, _ in split]
    out = {"dp": [], "tp": []}
    shapes = mem.quantised_layers(job, layout)
    backward = job.quantised_backward if len(job.quantised_backward) == len(shapes) else ()
    for (a, b), back in zip(shapes, backward or (True,) * len(shapes), strict=True):
        uses = 1 + (layout.recompute == "full") + back
        steps = gather_steps(a, b, sizes, job.finetune.base_quant)  # innermost first
        for dim, nbytes in zip(reversed(dims), steps, strict=True):
            out[dim] += [nbytes] * uses
    return out


def collective_calls(job: Job, layout: Layout) -> dict[str, int]:
    """Training collectives per rank per step by mesh dimension, as comm.py counts them (a
    point-to-point send is one call; its receive is the sender's): each pays the link's
    latency whatever its size. They follow `traffic`'s reasoning call by call."""
    spec = job.spec
    m, dp, t, p, v = layout.micro_batches(job), layout.dp, layout.tp, layout.pp, layout.pp_virtual
    every = mem.stage_units(job, layout, 0)
    units = [u for u in every if any(e[1] for e in u.entries)]
    n_units = sum(u.count for u in units)
    if job.engine.zero3_per_tensor and layout.zero == 3:  # a call per parameter tensor
        n_units = sum(u.count * sum(1 for e in u.entries if e[1]) for u in units)
    quantised = _quant_uses(job, layout)  # a split base's gathers per micro-batch, by dim
    dp_calls = 0
    if dp > 1:  # ZeRO-0: one all-reduce per bucket; ZeRO-1/2/3: per unit, as in `traffic`
        dp_calls = {
            0: sum(bucket_calls(job, layout, b) for b in _buckets(units, job.br, job.bucket_mb)),
            1: 2 * n_units,
            2: (m + 1) * n_units,
            3: m * n_units + zero3_gathers(job, layout),
        }[layout.zero]
        if layout.zero == 3:  # a quantised linear's gathers (`traffic_by_kind`)
            dp_calls += m * len(quantised["dp"])
    tp_calls = 0
    if t > 1:  # per layer 2 forward + 2 backward (sp: an all-gather/reduce-scatter pair for
        # each, 8); embedding, head and vocabulary-parallel loss 4 (sp: 6); full recompute
        # repeats 1 (sp 3) per layer; the partial gradients' all-reduce once per step
        layers = -(-spec.n_layers // p)
        redo = (
            (4 if layout.sp else 2) if job.engine.recompute_whole_block else (3 if layout.sp else 1)
        )
        per_layer = (8 if layout.sp else 4) + redo * (layout.recompute == "full")
        per_layer += _regathers(job, layout)
        tp_calls = m * (per_layer * layers + (6 if layout.sp else 4) - _skips_first_entry(job))
        tp_calls += 1 if _tp_partial(job, t, layout.sp) else 0
        tp_calls += m * len(quantised["tp"])
    pp_calls = 0
    if p > 1:  # one send per micro-batch and chunk boundary (as `traffic`), plus the tied
        # embedding/head gradient all-reduce between the first and last stage
        pp_calls = m * (2 * v - (1 if p == 2 else 0)) + (1 if spec.tie_embeddings else 0)
    return {"dp": dp_calls, "tp": tp_calls, "pp": pp_calls}


def _regathers(job: Job, layout: Layout) -> int:
    """All-gathers per layer that sp's backward runs again (`Engine.sp_regather`)."""
    return 2 if layout.sp and job.engine.sp_regather else 0


def tp_hidden_seconds(job: Job, layout: Layout, one: dict[str, float]) -> float:
    """Seconds of tp communication per micro-batch that backward's GEMMs hide on the busiest
    stage (`Engine.tp_overlap_backward`): per layer the input gradient's reduction (2
    all-reduces; sp: 2 reduce-scatters) behind the weight-gradient GEMMs, sp's re-gathers
    behind the input-gradient GEMMs. `one` is one call's seconds by kind."""
    hw, spec, t = job.hardware, job.spec, layout.tp
    if not (job.engine.tp_overlap_backward and t > 1 and hw.kernel_model):
        return 0.0
    tokens, peak = layout.micro_batch * job.seq_len, hw.peak[job.precision]
    dgrad, wgrad = gpu.backward_gemm_seconds(hw, spec, t, tokens, job.bc, peak)
    reduce = 2 * one["reduce_scatter" if layout.sp else "all_reduce"]
    hidden = min(reduce, wgrad) + min(_regathers(job, layout) * one["all_gather"], dgrad)
    return hidden * -(-spec.n_layers // layout.pp)


def zero3_gathers(job: Job, layout: Layout) -> int:
    """ZeRO-3's parameter all-gathers per rank per step: every unit (a tensor, for an engine
    that gathers parameter by parameter) before its forward and its backward, but none for the
    backward of the leading frozen units; a tied head gathers the embedding again."""
    m, every = layout.micro_batches(job), mem.stage_units(job, layout, 0)
    per = (lambda u: len(u.entries)) if job.engine.zero3_per_tensor else (lambda u: 1)
    calls = 2 * m * sum(u.count * per(u) for u in every)
    calls -= m * sum(u.count * per(u) for u in _leading_frozen(every))
    return calls + (m if job.spec.tie_embeddings and layout.pp == 1 else 0)


def _buckets(units, nbytes: int, cap_mb: float) -> list[list[tuple]]:
    """parallel/data.py's buckets, as (unit, entry) lists: trainable parameters in reverse
    order, a new bucket when the next one would pass the cap."""
    cap, out, size = int(cap_mb * 1024 * 1024), [], 0
    for u in reversed(units):
        for _ in range(u.count):
            for e in reversed(u.entries):
                if not e[1]:
                    continue
                if not out or (size and size + e[0] * nbytes > cap):
                    out.append([])
                    size = 0
                out[-1].append((u, e))
                size += e[0] * nbytes
    return out


def _skips_first_entry(job: Job) -> bool:
    """LoRA with an adapter on a q/k/v projection: nothing before the first block's attention
    needs a gradient (the embedding is frozen), so the backward of its tp entry (the input
    gradient's reduction) does not run."""
    ft = job.finetune
    return ft.lora and any(tag in ft.lora_targets for tag in ("wq", "wk", "wv"))


# models/tp_plans: the output projections are row-parallel (their input split), the rest column
_ROW_PARALLEL = ("wo", "w2")


def _tp_partial(job: Job, t: int, sp: bool) -> int:
    """Elements of replicated parameters whose gradients are all-reduced over tp: with sp the
    norms (and GPT-2's row-layer biases and positions) saw only a sequence chunk; kv heads
    shared by several ranks' query heads (t > kv) always; LoRA adapters whole on every rank
    (parallel/tensor_lora: A of a column-parallel target, B of a row-parallel one)."""
    spec, ft, out = job.spec, job.finetune, 0
    if ft.lora:
        shapes = linear_shapes(spec, 1)
        for tag in ft.lora_targets:
            fan_in, fan_out = shapes.get(tag, (0, 0))
            out += spec.n_layers * ft.lora_rank * (fan_out if tag in _ROW_PARALLEL else fan_in)
    if sp:
        norms = (2 * spec.n_layers + 1) * spec.dim
        out += norms * (2 if spec.arch == "gpt2" else 1)
        if spec.arch == "gpt2":
            out += 2 * spec.n_layers * spec.dim + spec.max_seq_len * spec.dim
    if spec.n_kv_heads % t:
        out += 2 * spec.n_layers * spec.head_dim * spec.dim
    return out


def _bubble_units(layout: Layout) -> float:
    """Idle micro-batch slots per step: (p-1) for GPipe and 1F1B (bubble fraction
    (p-1)/(m+p-1)), (p-1)/v interleaved (Narayanan et al. 2021), ~(p-1)/3 for ZB-H1 (Qi et
    al. 2024, with equal F, B and W times)."""
    p = layout.pp
    if p == 1:
        return 0.0
    return {"interleaved": (p - 1) / layout.pp_virtual, "zb": (p - 1) / 3}.get(
        layout.pp_schedule, float(p - 1)
    )


def _micro_batch_seconds(job: Job, layout: Layout) -> float:
    """Forward + backward of one micro-batch on the busiest pipeline stage (its blocks and
    the head with the loss), on one device."""
    hw, spec, s, t, p = job.hardware, job.spec, job.seq_len, layout.tp, layout.pp
    tokens_mb = layout.micro_batch * s
    layers = max(r[0] for r in mem.job_split(job, layout))
    if hw.measured_kernels:  # this CPU: the real modules timed at this layout's shapes
        block = kernels.block_seconds(spec, t, tokens_mb, s, job.precision, layout.recompute)
        head = kernels.head_seconds(spec.dim, spec.vocab_size // t, tokens_mb, job.precision)
        if block is not None and head is not None:
            return layers * block + head
    if hw.kernel_model:  # a GPU: kernel by kernel (plan/gpu.py)
        return gpu.micro_batch_seconds(hw, job, layout, layers)
    flops_mb = hardware_flops_per_token(job, layout) * tokens_mb / (t * p)
    # the efficiency covers a block's element-wise kernels (norms, softmax, casts) too (the
    # data-sheet default on GPUs), plus a fixed cost per layer (and one more for embedding,
    # head and loss) that small micro-batches do not amortise
    passes = 2 if layout.recompute == "full" else 1
    return flops_mb / hw.flops(job.precision) + passes * (layers + 1) * hw.block_overhead


def step_time(
    job: Job,
    layout: Layout,
    mem_bytes: dict[str, float],
    kinds: dict[str, dict[str, float]] | None = None,
    calls: dict[str, int] | None = None,
) -> dict[str, float]:
    """Seconds per step by part, and `step_s` their sum; `kinds` and `calls` are this layout's
    `traffic_by_kind` and `collective_calls` where the caller has them already."""
    hw = job.hardware
    m, t, p, dp = layout.micro_batches(job), layout.tp, layout.pp, layout.dp
    ranks_here = min(job.devices, hw.per_node)
    slowdown = max(1.0, ranks_here / hw.cores) if hw.cores else 1.0
    t_mb = slowdown * _micro_batch_seconds(job, layout)
    if job.finetune.quantised:  # NF4/int8 -> bf16 dequantisation before every use of a weight
        uses = 3 if layout.recompute == "full" else 2
        n = (job.matmul_params or non_embedding_params(job.spec)) / (t * p)
        stored = mem.QUANT_BYTES[job.finetune.base_quant]
        t_mb += slowdown * uses * n * (stored + job.bc) / (hw.hbm_bw * hw.mem_eff)
    compute = m * t_mb
    bubble = _bubble_units(layout) * t_mb
    kinds = traffic_by_kind(job, layout) if kinds is None else kinds
    calls = collective_calls(job, layout) if calls is None else calls
    intra, inter = hw.intra_bw * hw.comm_eff, hw.inter_bw * hw.comm_eff

    def comm_s(dim: str, ranks: int, per_node: int = 1, steps: int = 0) -> float:
        # a group spanning nodes runs one ring (NCCL channel) per NIC it has there: its
        # `per_node` ranks in a node each send through their own NIC, so a node's data crosses
        # per_node links at once (all-gathers, reduce-scatters and all-reduces); at most the
        # links inside the node (NVLink), which every ring also crosses. Each call pays its
        # ring's `steps` hops between nodes.
        bw = intra if ranks <= hw.per_node else min(intra, inter * per_node)
        cost = sum(n * hw.collective_cost.get(k, 1.0) for k, n in kinds[dim].items())
        hops = steps * hw.hop_s if ranks > hw.per_node else 0.0
        return (cost / bw + calls[dim] * (hw.latency + hops)) * slowdown

    # tp is innermost in the mesh: a dp group has per_node / tp of its ranks in a node;
    # pipeline sends go from one rank to one rank, each through its own NIC
    dp_here = max(1, min(dp, hw.per_node // t))
    tp_s, pp_s = comm_s("tp", t), comm_s("pp", t * dp * p)
    if job.engine.tp_overlap_backward and t > 1:  # one call's seconds of each kind, in a node
        act = layout.micro_batch * job.seq_len * job.spec.dim * job.bc
        ring = _ring(t) * act / (intra if t <= hw.per_node else min(intra, inter))
        one = {
            k: (n * ring * hw.collective_cost.get(k, 1.0) + hw.latency) * slowdown
            for k, n in (("all_reduce", 2), ("reduce_scatter", 1), ("all_gather", 1))
        }
        tp_s -= m * tp_hidden_seconds(job, layout, one)
    dp_s = comm_s("dp", t * dp, dp_here, (dp - 1) * (2 if layout.zero == 0 else 1))
    if layout.zero == 3 and dp > 1 and job.engine.list_all_gather:  # dp copies per gather,
        # each launched from the host, and the gathered bytes read and written once more
        copied = 2 * kinds["dp"].get("all_gather", 0.0) * dp / (dp - 1)
        dp_s += slowdown * (
            zero3_gathers(job, layout) * dp * hw.launch_s + copied / (hw.hbm_bw * hw.mem_eff)
        )
    # what can hide: gradient reduction behind backward (2/3 of compute) of the syncing
    # micro-batch (ZeRO-0/1) or of every micro-batch (ZeRO-2/3, which also prefetch gathers
    # behind forward); ZeRO-1/2's all-gather of updated slices runs after the step, exposed
    hideable = {0: 1.0, 1: job.br / (job.br + job.bc), 2: 1.0 - 1.0 / (m * job.br / job.bc + 1)}
    hide_window = (2 / 3 * t_mb) if layout.zero <= 1 else compute
    overlap = hw.overlap if job.engine.overlap_dp else 0.0
    hidden = min(dp_s * hideable.get(layout.zero, 1.0), overlap * hide_window)
    dp_exposed = dp_s - hidden
    local = mem_bytes.get("master", 0) + mem_bytes.get("host_master", 0)
    elems = local / 4 if local else mem_bytes["optimizer"] / 8
    if layout.offload in ("optimizer+nvme", "params+nvme"):  # host_master: only the slots
        elems = mem_bytes["disk_optimizer"] / 12
    if hw.measured_kernels:  # the optimizer runs on this CPU: its measured rate
        optimizer = elems * kernels.adam_seconds_per_element() * slowdown
    else:
        opt_bw = hw.host_mem_bw if layout.offload != "none" else hw.hbm_bw * hw.mem_eff
        optimizer = elems * ADAM_BYTES * slowdown / opt_bw
    offload = disk = 0.0
    if layout.offload != "none":  # gradients down, updated parameters up, every step
        offload = elems * (job.br + job.bc) / hw.host_bw
        if layout.offload == "optimizer+params":  # slices fetched for every gather
            offload += 2 * m * mem_bytes.get("host_params", 0) / hw.host_bw
    if layout.offload in ("optimizer+nvme", "params+nvme"):  # the state read and written once
        # per step while the CPU steps the chunk before (double-buffered): what it does not cover
        disk = max(0.0, 2 * mem_bytes["disk_optimizer"] / hw.disk_bw - optimizer)
        # params+nvme: each slice read for every gather (2 per micro-batch, as host offload)
        disk += 2 * m * mem_bytes.get("disk_params", 0) / hw.disk_bw
    squeeze = slowdown * compression.seconds(job, layout, mem.stage_units(job, layout, 0))
    parts = {
        "compute_s": compute,
        "bubble_s": bubble,
        "tp_comm_s": tp_s,
        "pp_comm_s": pp_s,
        "dp_comm_s": dp_s,
        "dp_exposed_s": dp_exposed,
        "optimizer_s": optimizer,
        "offload_s": offload,
        "compression_s": squeeze,
        "disk_s": disk,  # (the part of the disk traffic the optimizer step does not cover)
    }
    parts["step_s"] = (
        compute + bubble + tp_s + pp_s + dp_exposed + optimizer + offload + squeeze + disk
    )
    return parts
