"""Step time per rank: compute, pipeline bubble, tensor/pipeline/data-parallel communication
(with the part hidden behind backward), optimizer step and offload transfers.

The traffic and the calls are plan/traffic.py's (as comm.py counts them); a collective's time
is its bytes over the link's bandwidth (ring all-reduce: Patarasuk & Yuan 2009) plus a fixed
latency per call (the alpha-beta model, Hockney 1994).
"""

from __future__ import annotations

from shardwise.plan import activations as act
from shardwise.plan import compression, gpu, kernels, moe, peers
from shardwise.plan import memory as mem
from shardwise.plan.layout import Job, Layout
from shardwise.plan.shapes import non_embedding_params
from shardwise.plan.traffic import (
    collective_calls,
    regathers,
    ring_share,
    traffic_by_kind,
    zero3_gathers,
)

# bytes per element of one fused AdamW step: reads param, grad, 2 moments (fp32), writes 3
ADAM_BYTES = 28


# what `mfu` and `hfu` count, so figures compare like-for-like with a paper's convention
FLOP_CONVENTION = (
    "MFU: model FLOPs per token 6N + 12·L·h·s (PaLM, Chowdhery et al. 2022, app. B; N the "
    "non-embedding parameters, a tied head counted; attention's QK^T and AV over the whole "
    "s x s square, not halved for causal masking; LoRA: 4N). mfu_causal: the same with the "
    "attention term halved (6N + 6·L·h·s: the score blocks a causal kernel computes). HFU: "
    "the FLOPs executed, recomputation included (full: + 2N + 4·L·h·s, selective: + 4·L·h·s). "
    "MoE: N counts the active parameters only (6·N_active: the routers, the shared experts and "
    "top_k of the n_experts routed experts of each MoE layer), as Megatron-Core and "
    "training/metrics.py count them."
)


def model_flops_per_token(job: Job, causal: bool = False) -> float:
    """6N + 12·L·h·s (PaLM, Chowdhery et al. 2022, app. B): the MFU numerator; `causal`
    halves the attention term (6·L·h·s). With LoRA the frozen weights need no weight
    gradient: 4N (adapters are negligible)."""
    spec = job.spec
    n = moe.active_params(job) * (4.0 if job.finetune.lora else 6.0)  # MoE: active only
    # h of the attention term is its width, n_heads · head_dim: QK^T and AV are that wide
    # (Megatron-Core's num_floating_point_operations counts its query_projection_size)
    return n + (6.0 if causal else 12.0) * spec.n_layers * spec.q_dim * job.seq_len


def hardware_flops_per_token(job: Job, layout: Layout) -> float:
    """FLOPs actually executed: recomputation repeats the forward (2N + 4Lhs: Korthikanti
    et al. 2022 §5) or only attention (4Lhs, selective); LoRA skips the frozen weights'
    gradient (2N of the 6N) but adds its adapters."""
    spec, s = job.spec, job.seq_len
    n = moe.active_params(job)  # (MoE: the experts a token is routed to)
    attn = 12.0 * spec.n_layers * spec.q_dim * s
    flops = 6.0 * n + attn
    if job.finetune.lora:
        flops -= 2.0 * n
    if layout.recompute == "full":
        flops += 2.0 * n + attn / 3
    elif layout.recompute == "selective" and peers.of(job).selective_ops:
        # every second matmul again (activations.op_sac_terms): 2 FLOPs per weight
        again = sum(k * n for _, k, n, _ in act.linears(spec)[1::2])
        flops += 2.0 * spec.n_layers * again
    elif layout.recompute == "selective":
        flops += attn / 3
    return flops


def tp_hidden_seconds(job: Job, layout: Layout, one: dict[str, float]) -> float:
    """Seconds of tp communication per micro-batch that backward's GEMMs hide on the busiest
    stage (`peers.Deviations.tp_overlap_backward`): per layer the input gradient's reduction (2
    all-reduces; sp: 2 reduce-scatters) behind the weight-gradient GEMMs, sp's re-gathers
    behind the input-gradient GEMMs. `one` is one call's seconds by kind."""
    hw, spec, t = job.hardware, job.spec, layout.tp
    if not (peers.of(job).tp_overlap_backward and t > 1 and hw.kernel_model):
        return 0.0
    tokens, peak = layout.micro_batch * job.seq_len, gpu.linear_peak(hw, job)
    dgrad, wgrad = gpu.backward_gemm_seconds(hw, spec, t, tokens, job.bc, peak)
    reduce = 2 * one["reduce_scatter" if layout.sp else "all_reduce"]
    hidden = min(reduce, wgrad) + min(regathers(job, layout) * one["all_gather"], dgrad)
    return hidden * -(-spec.n_layers // layout.pp)


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


def _dequant_seconds(job: Job, layout: Layout, slowdown: float) -> float:
    """Seconds per micro-batch of NF4/int8 -> bf16 dequantisation before every use of a
    frozen low-bit weight (0 without a quantised base)."""
    if not job.finetune.quantised:
        return 0.0
    hw, t, p = job.hardware, layout.tp, layout.pp
    uses = 3 if layout.recompute == "full" else 2
    n = (job.matmul_params or non_embedding_params(job.spec)) / (t * p)
    stored = mem.QUANT_BYTES[job.finetune.base_quant]
    return slowdown * uses * n * (stored + job.bc) / (hw.hbm_bw * hw.mem_eff)


def _link(job: Job, ranks: int, per_node: int = 1) -> float:
    """Bandwidth (bytes/s) of a ring over `ranks` ranks, `per_node` of them in each node."""
    hw = job.hardware
    intra, inter = hw.intra_bw * hw.comm_eff, hw.inter_bw * hw.comm_eff
    # a group spanning nodes runs one ring (NCCL channel) per NIC it has there: its
    # `per_node` ranks in a node each send through their own NIC, so a node's data crosses
    # per_node links at once (all-gathers, reduce-scatters and all-reduces); at most the
    # links inside the node (NVLink), which every ring also crosses
    return intra if ranks <= hw.per_node else min(intra, inter * per_node)


def _comm_seconds(
    job: Job,
    traffic: tuple[dict[str, dict[str, float]], dict[str, int]],
    dim: str,
    ranks: int,
    per_node: int = 1,
    group: int = 1,
    rounds: int = 1,
) -> float:
    """Seconds of `dim`'s collectives per step: bytes over the link (weighted by kind) and a
    latency per call; `traffic` is (`traffic_by_kind`, `collective_calls`)."""
    hw, (kinds, calls) = job.hardware, traffic
    # each call of a `group`-rank ring that spans nodes pays its steps (`rounds` times
    # group - 1), those between nodes a network hop, the others an NVLink hop
    bw = _link(job, ranks, per_node)
    cost = sum(n * hw.collective_cost.get(k, 1.0) for k, n in kinds[dim].items())
    hops = 0.0
    if ranks > hw.per_node:
        between = rounds * (-(-group // per_node) - 1)
        hops = between * hw.hop_s + (rounds * (group - 1) - between) * hw.nvlink_hop_s
    return (cost / bw + calls[dim] * (hw.latency + hops)) * hw.slowdown(job.devices)


def _tp_seconds(job: Job, layout: Layout, traffic: tuple) -> float:
    """Seconds of tp communication per step, less what backward's GEMMs hide."""
    hw, t, m = job.hardware, layout.tp, layout.micro_batches(job)
    tp_s = _comm_seconds(job, traffic, "tp", t)
    if peers.of(job).tp_overlap_backward and t > 1:  # one call's seconds of each kind
        act = layout.micro_batch * job.seq_len * job.spec.dim * job.bc
        ring = ring_share(t) * act / _link(job, t)
        one = {
            k: (n * ring * hw.collective_cost.get(k, 1.0) + hw.latency) * hw.slowdown(job.devices)
            for k, n in (("all_reduce", 2), ("reduce_scatter", 1), ("all_gather", 1))
        }
        tp_s -= m * tp_hidden_seconds(job, layout, one)
    return tp_s


def _dp_seconds(job: Job, layout: Layout, traffic: tuple) -> float:
    """Seconds of dp communication per step (gradient reduction, ZeRO's gathers)."""
    hw, t, dp = job.hardware, layout.tp, layout.dp
    # tp is innermost in the mesh: a dp group has per_node / tp of its ranks in a node
    dp_here = max(1, min(dp, hw.per_node // t))
    dp_s = _comm_seconds(job, traffic, "dp", t * dp, dp_here, dp, 2 if layout.zero == 0 else 1)
    if layout.zero == 3 and dp > 1 and peers.of(job).list_all_gather:  # dp copies per gather,
        # each launched from the host, and the gathered bytes read and written once more
        copied = 2 * traffic[0]["dp"].get("all_gather", 0.0) * dp / (dp - 1)
        dp_s += hw.slowdown(job.devices) * (
            zero3_gathers(job, layout) * dp * hw.launch_s + copied / (hw.hbm_bw * hw.mem_eff)
        )
    return dp_s


def _dp_hidden(job: Job, layout: Layout, dp_s: float, t_mb: float) -> float:
    """Seconds of `dp_s` hidden behind backward (and ZeRO-2/3's forward)."""
    m = layout.micro_batches(job)
    # what can hide: gradient reduction behind backward (2/3 of compute) of the syncing
    # micro-batch (ZeRO-0/1) or of every micro-batch (ZeRO-2/3, which also prefetch gathers
    # behind forward); ZeRO-1/2's all-gather of updated slices runs after the step, exposed
    hideable = {0: 1.0, 1: job.br / (job.br + job.bc), 2: 1.0 - 1.0 / (m * job.br / job.bc + 1)}
    hide_window = (2 / 3 * t_mb) if layout.zero <= 1 else m * t_mb
    overlap = job.hardware.overlap if peers.of(job).overlap_dp else 0.0
    return min(dp_s * hideable.get(layout.zero, 1.0), overlap * hide_window)


def _optimizer_elements(layout: Layout, mem_bytes: dict[str, float]) -> float:
    """Elements the optimizer steps on this rank, from its predicted state bytes."""
    local = mem_bytes.get("master", 0) + mem_bytes.get("host_master", 0)
    elems = local / 4 if local else mem_bytes["optimizer"] / 8
    if layout.offload in ("optimizer+nvme", "params+nvme"):  # host_master: only the slots
        elems = mem_bytes["disk_optimizer"] / 12
    return elems


def _optimizer_seconds(job: Job, layout: Layout, elems: float) -> float:
    """Seconds of the optimizer step over `elems` elements, where the state lives."""
    hw, slowdown = job.hardware, job.hardware.slowdown(job.devices)
    if hw.measured_kernels:  # the optimizer runs on this CPU: its measured rate
        return elems * kernels.optimizer_seconds_per_element() * slowdown
    opt_bw = hw.host_mem_bw if layout.offload != "none" else hw.hbm_bw * hw.mem_eff
    return elems * ADAM_BYTES * slowdown / opt_bw


def _offload_seconds(
    job: Job, layout: Layout, mem_bytes: dict[str, float], elems: float, optimizer: float
) -> tuple[float, float]:
    """(host transfer seconds, disk seconds the optimizer step does not cover) per step."""
    hw, m = job.hardware, layout.micro_batches(job)
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
    return offload, disk


def step_time(
    job: Job,
    layout: Layout,
    mem_bytes: dict[str, float],
    kinds: dict[str, dict[str, float]] | None = None,
    calls: dict[str, int] | None = None,
) -> dict[str, float]:
    """Seconds per step by part, and `step_s` their sum; `kinds` and `calls` are this layout's
    `traffic_by_kind` and `collective_calls` where the caller has them already."""
    m, t, p, dp = layout.micro_batches(job), layout.tp, layout.pp, layout.dp
    slowdown = job.hardware.slowdown(job.devices)
    t_mb = slowdown * _micro_batch_seconds(job, layout)
    t_mb += _dequant_seconds(job, layout, slowdown)
    compute = m * t_mb
    bubble = _bubble_units(layout) * t_mb
    kinds = traffic_by_kind(job, layout) if kinds is None else kinds
    calls = collective_calls(job, layout) if calls is None else calls
    traffic = (kinds, calls)
    # pipeline sends go from one rank to one rank, each through its own NIC
    tp_s, pp_s = _tp_seconds(job, layout, traffic), _comm_seconds(job, traffic, "pp", t * dp * p)
    dp_s = _dp_seconds(job, layout, traffic)
    dp_exposed = dp_s - _dp_hidden(job, layout, dp_s, t_mb)
    elems = _optimizer_elements(layout, mem_bytes)
    optimizer = _optimizer_seconds(job, layout, elems)
    offload, disk = _offload_seconds(job, layout, mem_bytes, elems, optimizer)
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
