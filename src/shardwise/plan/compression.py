"""The planner's view of `parallel.grad_compression` (parallel/compress.py, and the 16-bit
reduce-scatters of parallel/zero.py): the bytes a step sends, its all-reduce calls per
bucket, the state compression keeps and the compute it adds.

PowerSGD needs each gradient's shape: a real model's units carry it; for the presets the
block linears, embeddings, head and LoRA adapters are named. Anything else is counted as
sent whole (as the engine does with vectors)."""

from __future__ import annotations

from shardwise.parallel.compress import compressed_shape, wire_elements
from shardwise.plan import shapes as shapes_of
from shardwise.plan.layout import Job, Layout


def matrix(job: Job, layout: Layout, unit, entry: tuple) -> tuple[int, ...] | None:
    """The gradient's shape where the planner knows it, else None."""
    tag = entry[2] if len(entry) > 2 else ""
    if isinstance(tag, tuple):
        return tag
    if job.spec is None:
        return None
    shapes = shapes_of.linear_shapes(job.spec, layout.tp)
    if tag in shapes:
        fan_in, fan_out = shapes[tag]
        return (fan_out, fan_in)
    if tag in ("lora_A", "lora_B"):
        return (job.finetune.lora_rank, entry[0] // job.finetune.lora_rank)
    if unit.name in ("embed", "pos_embed", "head") and len(unit.entries) == 1:
        return (entry[0] // job.spec.dim, job.spec.dim)
    return None


def _compressed(job: Job, layout: Layout, unit, entry: tuple) -> tuple[int, int] | None:
    shape = matrix(job, layout, unit, entry)
    return None if shape is None else compressed_shape(shape, job.powersgd_rank)


def _trainable(units) -> list[tuple]:
    return [(u, e) for u in units for e in u.entries if e[1] for _ in range(u.count)]


def wire_bytes(job: Job, layout: Layout) -> int:
    """Bytes per gradient element on a ZeRO reduce-scatter (16-bit wires included)."""
    return 2 if layout.compression in ("bf16", "fp16") else job.br


def zero_wire_copy(layout: Layout) -> int:
    """Bytes per element of the 16-bit copy each ZeRO reduce-scatter keeps in flight (0: none)."""
    return 2 if layout.compression in ("bf16", "fp16") and layout.dp > 1 else 0


def sent_bytes(job: Job, layout: Layout, units) -> float:
    """Bytes of one step's ZeRO-0 gradient all-reduce payload per rank, before the ring's
    2(n-1)/n: the gradients in precision.reduce, half of fp32 on a 16-bit wire, or
    PowerSGD's r·(m+n) per compressed matrix plus every other element (fp32)."""
    trainable = _trainable(units)
    if layout.compression in ("bf16", "fp16"):
        return 2.0 * sum(e[0] for _, e in trainable)
    if layout.compression != "powersgd":
        return float(job.br * sum(e[0] for _, e in trainable))
    total = 0
    for u, e in trainable:
        shape = matrix(job, layout, u, e)
        total += e[0] if shape is None else wire_elements([shape], job.powersgd_rank)
    return 4.0 * total


def bucket_calls(job: Job, layout: Layout, bucket: list[tuple]) -> int:
    """All-reduces of one bucket: PowerSGD sends P (with the uncompressed tensors) and then
    Q when the bucket holds a matrix it compresses."""
    if layout.compression != "powersgd":
        return 1
    return 1 + any(_compressed(job, layout, u, e) is not None for u, e in bucket)


def state_bytes(job: Job, layout: Layout, units) -> float:
    """What compression keeps beside the gradients (the `buffers` category): the 16-bit
    copies of every bucket in flight at the end of backward, or PowerSGD's error memory
    (m·n), warm-start Q (n·r), and the two all-reduce buffers (P with the uncompressed
    elements, Q), fp32."""
    if layout.zero or layout.dp == 1 or layout.compression == "none":
        return 0.0
    trainable = _trainable(units)
    if layout.compression in ("bf16", "fp16"):
        return 2.0 * sum(e[0] for _, e in trainable)
    r, total = job.powersgd_rank, 0
    for u, e in trainable:
        mn = _compressed(job, layout, u, e)
        total += e[0] if mn is None else mn[0] * mn[1] + 2 * mn[1] * r + mn[0] * r
    return 4.0 * total


def seconds(job: Job, layout: Layout, units) -> float:
    """Compute the compression adds per step (not hidden: it runs beside backward on the same
    cores, then after it): a 16-bit wire casts every bucket down and the sum back (6 bytes
    per element each way); PowerSGD multiplies each compressed M by Q, Mᵀ by P and P by Qᵀ
    (6·m·n·r FLOPs, fp32) and passes over M about five times (error in, two products, error
    out, result), 4 bytes each."""
    if layout.dp == 1 or layout.compression == "none":
        return 0.0
    hw, trainable = job.hardware, _trainable(units)
    bw = hw.hbm_bw * hw.mem_eff
    if layout.compression in ("bf16", "fp16"):
        # ZeRO casts every unit's flat gradients at each reduce-scatter (ZeRO-2/3: every
        # micro-batch) and takes its own slice back
        times = layout.micro_batches(job) if layout.zero >= 2 else 1
        return 12.0 * times * sum(e[0] for _, e in trainable) / bw
    flops = moved = 0.0
    for u, e in trainable:
        mn = _compressed(job, layout, u, e)
        if mn is not None:
            flops += 6.0 * mn[0] * mn[1] * job.powersgd_rank
            moved += 5 * 4.0 * mn[0] * mn[1]
    return flops / hw.flops("fp32") + moved / bw
