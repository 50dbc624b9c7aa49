"""What a layout sends: ring-equivalent bytes per rank per step by mesh dimension and
collective kind, and the calls that carry them, as the comm layer (distributed/comm.py)
counts them, so predicted and measured `comm_bytes` compare key by key (docs/design.md). The time
they take is plan/time.py's."""

from __future__ import annotations

from collections import Counter

from shardwise.finetune.quant_shards import gather_steps
from shardwise.plan import memory as mem
from shardwise.plan import peers
from shardwise.plan.buffers import align_of, padded_numel
from shardwise.plan.compression import bucket_calls, sent_bytes, wire_bytes
from shardwise.plan.layout import Job, Layout
from shardwise.plan.lora_traffic import unrun_backward
from shardwise.plan.pp_traffic import pp_bytes, pp_calls
from shardwise.plan.stage_chunks import stage_blocks
from shardwise.plan.tp_partial import moe_tp_layers, partial_of, tp_partial


def ring_share(n: int) -> float:
    """The share of a collective's bytes each of `n` ring ranks sends: (n - 1) / n."""
    return (n - 1) / n if n > 1 else 0.0


def traffic(job: Job, layout: Layout, stage: int | None = None) -> dict[str, float]:
    """Ring-equivalent bytes sent per rank per step over dp, tp and pp (`stage`: as
    `stage_holds`)."""
    return traffic_totals(traffic_by_kind(job, layout, stage))


def stage_holds(job: Job, layout: Layout, stage: int | None = None) -> tuple[int, bool, bool]:
    """(blocks, the embedding, the head and loss) whose tp and pp traffic a rank sends: those
    of pipeline rank `stage` (memory.job_split: the engine's cut), or with None those the step
    time prices (plan/time.py: the busiest stage, ⌈L/p⌉ blocks, with both ends)."""
    if stage is None or layout.pp == 1:
        return -(-job.spec.n_layers // layout.pp), True, True
    return mem.job_split(job, layout)[stage]


def traffic_totals(by_kind: dict[str, dict[str, float]]) -> dict[str, float]:
    """`traffic_by_kind` summed over the kinds of each mesh dimension."""
    return {dim: sum(kinds.values()) for dim, kinds in by_kind.items()}


def traffic_by_kind(
    job: Job, layout: Layout, stage: int | None = None
) -> dict[str, dict[str, float]]:
    """`traffic` split by collective kind (all_reduce, reduce_scatter, all_gather, send) per
    mesh dimension: the kinds cost differently per byte on some transports (gloo). dp is
    pipeline stage 0's; tp and pp those of `stage` (`stage_holds`)."""
    quantised = _quant_uses(job, layout)  # finetune/quant: a split base gathered per use
    return {
        "dp": _dp_kinds(job, layout, quantised["dp"]),
        "tp": _tp_kinds(job, layout, quantised["tp"], stage),
        "pp": {"send": pp_bytes(job, layout, stage)},
    }


def _dp_kinds(job: Job, layout: Layout, quantised: list[int]) -> dict[str, float]:
    """Bytes by kind over dp per step: the gradient reduction and ZeRO's gathers (parallel/
    zero.py), plus the split low-bit base's gathers (`quantised`: bytes per gather)."""
    spec, m, dp = job.spec, layout.micro_batches(job), layout.dp
    us, align = mem.stage_units(job, layout, 0), align_of(job)
    padded = sum(padded_numel(u, dp, align) * u.count for u in us)
    # frozen units (their own, parallel/zero.py) are neither reduced nor re-published
    reduced = sum(padded_numel(u, dp, align) * u.count for u in us if any(e[1] for e in u.entries))
    bc, ring = job.bc, ring_share(dp)
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
    if layout.zero == 3 and spec.tie_embeddings and layout.pp == 1:
        # the tied head is a second root of the embedding's unit: it is gathered again for
        # the head's forward (it was freed after the embedding's), once per micro-batch
        dp_kinds["all_gather"] += ring * -(-us[0].numel // dp) * dp * bc * m
    if quantised:
        dp_kinds["all_gather"] += ring * m * sum(quantised)
    return dp_kinds


def _tp_kinds(
    job: Job, layout: Layout, quantised: list[int], stage: int | None = None
) -> dict[str, float]:
    """Bytes by kind over tp per step of `stage` (`stage_holds`): the blocks' activations
    (parallel/tensor.py), the vocabulary-parallel loss, replicated parameters' gradients and
    the split base's gathers."""
    spec, s, b = job.spec, job.seq_len, layout.micro_batch
    m, t = layout.micro_batches(job), layout.tp
    act = b * s * spec.dim * job.bc
    held = stage_holds(job, layout, stage)
    layers, first, last = held
    # parallel/tensor.py, per micro-batch: per layer 2 all-reduces forward and 2 backward
    # (sp: all-gather + reduce-scatter pairs, the same bytes); the embedding and the head 1
    # each, where the stage holds them; the vocabulary-parallel loss (with the head)
    # all-reduces 3 fp32 values per token. Full recomputation repeats a block's forward up to
    # its last saved tensor: 1 all-reduce (sp: 3 halves); the whole forward, 2 (sp: 4
    # halves), where the engine recomputes whole blocks
    redo = 4 if peers.of(job).recompute_whole_block else (3 if layout.sp else 2)
    per_mb = 2 * (4 * layers + first + last) + redo * layers * (layout.recompute == "full")
    blocks = ring_share(t) * m * act * per_mb
    tp_kinds = {"all_reduce": ring_share(t) * m * 4 * 6 * b * s * last}
    if layout.sp:
        tp_kinds["all_gather"] = tp_kinds["reduce_scatter"] = blocks / 2
        tp_kinds["all_gather"] += ring_share(t) * m * act * regathers(job, layout) * layers
    else:
        tp_kinds["all_reduce"] += blocks
    indices = stage_blocks(job, layout, stage)  # of its blocks: which of them are MoE
    _moe_tp_kinds(job, layout, act, tp_kinds, moe_tp_layers(job, layout, layers, indices))
    for kind, n in _unrun(job, layout, first).items():  # LoRA: no gradient before an adapter
        tp_kinds[kind] -= ring_share(t) * m * act * n * (1 if layout.sp else 2)
    if t > 1:  # gradients of parameters replicated over tp ranks that each saw part of them,
        # summed in fp32 (the optimizer's master gradients) once per step. Under ZeRO a rank
        # sums only those in its slice: without the units' parameters this is an upper bound
        # (job/measured.sliced_partial_tp prices the slice where the model is built)
        partial = tp_partial(job, t, layout.sp, layout.ep, partial_of(held, stage), indices)
        tp_kinds["all_reduce"] += 2 * ring_share(t) * partial * 4
    if quantised:
        tp_kinds["all_gather"] = tp_kinds.get("all_gather", 0.0)
        tp_kinds["all_gather"] += ring_share(t) * m * sum(quantised)
    return tp_kinds


def _moe_tp_kinds(
    job: Job, layout: Layout, act: int, tp_kinds: dict[str, float], moe_layers: int
) -> None:
    """Adjust `tp_kinds` for a stage's `moe_layers` MoE layers (tp_partial.moe_tp_layers),
    whole on every tp rank, each on its own sequence shard (parallel/expert_comm.
    SequenceShards); `act` is one micro-batch's activation bytes."""
    if not moe_layers:
        return
    m, t = layout.micro_batches(job), layout.tp
    # no all-gather/reduce-scatter pair around its MLP forward or backward; its
    # per-(sequence, expert) counts [b, E] int64 all-gathered
    tp_kinds["all_gather"] -= ring_share(t) * m * act * 2 * moe_layers
    tp_kinds["reduce_scatter"] -= ring_share(t) * m * act * 2 * moe_layers
    forwards = 1 + (layout.recompute == "full")
    counts = ring_share(t) * m * t * layout.micro_batch * job.spec.n_experts * 8 * moe_layers
    tp_kinds["all_gather"] += counts * forwards
    if forwards > 1:  # the recomputed block replays its counts' all-gather, not an MLP
        # input gather (its 3 calls: the attention's pair and the counts)
        tp_kinds["all_gather"] -= ring_share(t) * m * act * moe_layers


def cp_traffic(job: Job, layout: Layout) -> tuple[dict[str, float], int]:
    """(bytes by kind, calls) each rank sends per step over cp for the attention's exchange
    (parallel/context_comm.py), as comm.py counts them; ({}, 0) at cp = 1. `layout` is the
    cp layout itself (dp: the sample streams), not its data-parallel equivalent.

    Per layer (of the largest pipeline stage) and micro-batch, with a K/V block of e =
    b·(H/tp)·(s/cp)·head_dim elements (k/v heads repeated to H; a peer with
    `Deviations.cp_kv_heads` sends the ring's at its k/v heads) and n = cp: every forward
    all-gathers the n·s/cp int64 positions ((n-1)/n of them sent). Ring: forward n-1 K/V blocks
    [2, e] in the compute dtype; backward the same n-1 and n-1 dK/dV blocks [2, e] in fp32 (with
    the zig-zag split every block pair has a visible key, so none is skipped). Ulysses: forward
    q/k/v [3, e] and the output [e] through all-to-alls, (n-1)/n of each sent; backward their
    gradients. A recomputed forward runs again up to its last saved tensor: the ring's whole
    Function (its saved out and lse are its end), a recomputed block's Ulysses exchanges too
    (its output projection saves the output), but a recomputed attention core's (selective)
    stops at the output's reordering, before the second all-to-all. Packed rows: Ulysses gathers
    each query's record start (b·s/cp int64) with the positions; the ring sends what it sends
    unpacked."""
    n = layout.cp
    if n == 1:
        return {}, 0
    spec, m, b = job.spec, layout.micro_batches(job), layout.micro_batch
    local = job.seq_len // n
    # a tp rank attends over its n_heads / tp heads; a pipeline stage runs its layers only
    e = b * (spec.n_heads // layout.tp) * local * spec.head_dim
    if peers.of(job).cp_kv_heads and layout.cp_mode == "ring":  # K/V blocks not repeated
        e = e * spec.n_kv_heads // spec.n_heads
    gather = (n - 1) * local * 8  # (n-1)/n of the n·local int64 positions
    if job.packed and layout.cp_mode == "ulysses":  # and of the b·n·local record starts
        gather *= 1 + b
    again = layout.recompute in ("selective", "full")
    forwards = 1 + again
    if layout.cp_mode == "ring":
        sends = (n - 1) * (forwards + 1) * 2 * e * job.bc + (n - 1) * 2 * e * 4
        kinds = {"all_gather": gather * forwards, "send": sends}
        calls = forwards + (n - 1) * (forwards + 2)
    else:
        # all-to-alls: q/k/v [3, e] and the output [e] forward, their gradients backward; a
        # recomputed core (selective) redoes only the first
        redo = {"none": 0, "selective": 3, "full": 4}[layout.recompute]
        kinds = {"all_gather": gather * forwards, "all_to_all": (8 + redo) * e * job.bc}
        kinds["all_to_all"] *= (n - 1) / n
        calls = forwards + 4 + {"none": 0, "selective": 1, "full": 2}[layout.recompute]
    scale = m * -(-spec.n_layers // layout.pp)
    return {k: v * scale for k, v in kinds.items()}, calls * scale


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


def collective_calls(job: Job, layout: Layout, stage: int | None = None) -> dict[str, int]:
    """Training collectives per rank per step by mesh dimension, as comm.py counts them (a
    point-to-point send is one call; its receive is the sender's): each pays the link's
    latency whatever its size. They follow `traffic`'s reasoning call by call (`stage`: tp's
    and pp's of that pipeline rank, `stage_holds`)."""
    m, dp, t = layout.micro_batches(job), layout.dp, layout.tp
    every = mem.stage_units(job, layout, 0)
    units = [u for u in every if any(e[1] for e in u.entries)]
    n_units = sum(u.count for u in units)
    if peers.of(job).zero3_per_tensor and layout.zero == 3:  # a call per parameter tensor
        n_units = sum(u.count * sum(1 for e in u.entries if e[1]) for u in units)
    quantised = _quant_uses(job, layout)  # a split base's gathers per micro-batch, by dim
    dp_calls = 0
    if dp > 1:  # ZeRO-0: one all-reduce per bucket; ZeRO-1/2/3: per unit, as in `traffic`
        if layout.zero == 0:  # (the buckets only where asked: they were most of a search)
            buckets = _buckets(units, job.br, job.bucket_mb)
            dp_calls = sum(bucket_calls(job, layout, b) for b in buckets)
        elif layout.zero in (1, 2):
            dp_calls = (2 if layout.zero == 1 else m + 1) * n_units
        else:
            dp_calls = m * n_units + zero3_gathers(job, layout)
        if layout.zero == 3:  # a quantised linear's gathers (`traffic_by_kind`)
            dp_calls += m * len(quantised["dp"])
    tp_calls = _tp_calls(job, layout, stage, len(quantised["tp"])) if t > 1 else 0
    return {"dp": dp_calls, "tp": tp_calls, "pp": pp_calls(job, layout, stage)}


def stage_traffic(job: Job, layout: Layout, stage: int) -> tuple[dict[str, float], dict[str, int]]:
    """(bytes, calls) over tp and pp of pipeline rank `stage`: `traffic`'s and
    `collective_calls`' entries for those dimensions, without pricing dp again."""
    quantised = _quant_uses(job, layout)["tp"]
    comm = {"tp": sum(_tp_kinds(job, layout, quantised, stage).values())}
    comm["pp"] = pp_bytes(job, layout, stage)
    tp_calls = _tp_calls(job, layout, stage, len(quantised)) if layout.tp > 1 else 0
    return comm, {"tp": tp_calls, "pp": pp_calls(job, layout, stage)}


def _tp_calls(job: Job, layout: Layout, stage: int | None, quantised: int) -> int:
    """`collective_calls`' tp entry (tp > 1) of `stage` (`stage_holds`); `quantised`: a split
    base's gathers over tp per micro-batch."""
    m, t = layout.micro_batches(job), layout.tp
    # per layer 2 forward + 2 backward (sp: an all-gather/reduce-scatter pair for each, 8);
    # the embedding 1 (sp: 2), the head 1 (sp: 2) and the vocabulary-parallel loss 2, where
    # the stage holds them; full recompute repeats 1 (sp 3) per layer; the partial gradients'
    # all-reduce once per step
    held = stage_holds(job, layout, stage)
    layers, first, last = held
    redo = (
        (4 if layout.sp else 2) if peers.of(job).recompute_whole_block else (3 if layout.sp else 1)
    )
    per_layer = (8 if layout.sp else 4) + redo * (layout.recompute == "full")
    per_layer += regathers(job, layout)
    unrun = sum(_unrun(job, layout, first).values())
    ends = (2 if layout.sp else 1) * (first + last) + 2 * last
    tp_calls = m * (per_layer * layers + ends - unrun)
    # an MoE layer: its MLP's 4 less, the counts' 1 more
    indices = stage_blocks(job, layout, stage)
    tp_calls -= m * 3 * moe_tp_layers(job, layout, layers, indices)
    partial = tp_partial(job, t, layout.sp, layout.ep, partial_of(held, stage), indices)
    tp_calls += 1 if partial else 0
    return tp_calls + m * quantised


def regathers(job: Job, layout: Layout) -> int:
    """All-gathers per layer that sp's backward runs again (`peers.Deviations.sp_regather`)."""
    return 2 if layout.sp and peers.of(job).sp_regather else 0


def zero3_gathers(job: Job, layout: Layout) -> int:
    """ZeRO-3's parameter all-gathers per rank per step: every unit (a tensor, for an engine
    that gathers parameter by parameter) before its forward and its backward, but none for the
    backward of the leading frozen units; a tied head gathers the embedding again."""
    m, every = layout.micro_batches(job), mem.stage_units(job, layout, 0)
    per = (lambda u: len(u.entries)) if peers.of(job).zero3_per_tensor else (lambda u: 1)
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


def _unrun(job: Job, layout: Layout, first: bool) -> Counter[str]:
    """`unrun_backward` where a stage holds the embedding; none elsewhere (a later stage's
    received activations need their gradient)."""
    return unrun_backward(job, layout) if first else Counter()


def ep_traffic(
    job: Job, layout: Layout, rows: tuple[float, float] | None = None, layers: int | None = None
):
    """(bytes, calls) per rank per step of expert parallelism's token exchange
    (parallel/expert_comm.py), as comm.py counts them under "ep"; (0.0, 0) at ep = 1.

    Per MoE layer and micro-batch, over n = ep ranks: the per-expert counts [E] int64 through
    an equal all-to-all ((n-1)/n of them sent), the rows a rank sends to other ranks' experts
    (`sent`) through the dispatch and the rows it computed for other ranks (`received`) back
    through the combine, in the compute dtype, `dim` wide; backward sends the gradients of
    both back the other way (received, then sent). A fully recomputed block exchanges its
    forward's counts and rows again. So a step sends
        forwards·L·m·(n-1)/n·E·8 + (forwards + 1)·(sent + received)·dim·bytes
    in L·m·(3·forwards + 2) calls, `sent`/`received` summed over the step's layers and
    micro-batches. They depend on the routing: `rows` gives the measured (sent, received);
    None prices balanced, dropless routing (every rank's b·s·k assignments per layer spread
    evenly over the experts, so (n-1)/n of them leave and as many arrive), the convention
    `explain` and `plan` state. `layers`: the MoE layers a rank runs (a pipeline stage's;
    default all). Under sp each tp rank routes its own s / tp tokens."""
    n, spec = layout.ep, job.spec
    if n == 1 or spec is None or not spec.n_experts:
        return 0.0, 0
    m = layout.micro_batches(job)
    layers = spec.n_layers // spec.moe_every if layers is None else layers
    forwards = 1 + (layout.recompute == "full")
    if rows is None:
        local = job.seq_len // layout.cp // (layout.tp if layout.sp else 1)
        each = layers * m * layout.micro_batch * local * spec.top_k
        rows = (each * ring_share(n), each * ring_share(n))
    counts = forwards * layers * m * ring_share(n) * spec.n_experts * 8
    moved = (forwards + 1) * (rows[0] + rows[1]) * spec.dim * job.bc
    return counts + moved, layers * m * (3 * forwards + 2)
