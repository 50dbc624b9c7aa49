"""Context parallelism's step time beyond its data-parallel equivalent.

`layout.as_data_parallel` prices a cp layout as dp x cp replicas that each see seq_len / cp
tokens: right for every matmul, norm and collective of the model states, short in two places
that this module adds back.

- Attention: a rank's local queries attend over the whole sequence, not only the local keys.
  With the causal mask balanced over the ranks (the zig-zag split of parallel/context.py) a
  rank computes 1/cp of the whole s x s triangle, cp times the (s/cp)^2 triangle the
  equivalent prices: (cp - 1) more of the equivalent's attention per layer, forward and
  backward (and again in a recomputed forward), where a fused kernel runs it (Ulysses' SDPA,
  a peer's flash ring). Our ring computes each block pair's scores in fp32 matmuls and
  element-wise passes: on a GPU that is the unfused attention at the fp32 peak.
- The exchange (traffic.cp_traffic's bytes and calls): the ring's K/V blocks travel while the
  block in hand is computed (Liu et al. 2023, "Ring Attention", §3), so only what exceeds the
  attention's own time is exposed; Ulysses' all-to-alls (Jacobs et al. 2023) sit on the
  critical path between the projections and the attention, all exposed. The positions'
  all-gather is exposed in both.
"""

from __future__ import annotations

from shardwise.plan import gpu, peers
from shardwise.plan.layout import Job, Layout


def _attention_seconds(job: Job, layout: Layout, mode: str, n: int) -> float:
    """Seconds the cp attention adds to one layer's, for one micro-batch of the data-parallel
    equivalent `job` (its local length s/n), forward + backward (+ a recomputed forward)."""
    hw, spec, s, b, t = job.hardware, job.spec, job.seq_len, layout.micro_batch, layout.tp
    passes = 1 + (layout.recompute in ("selective", "full"))  # forwards

    def core(c: int, peak: float, unfused: bool) -> float:
        fwd, bwd = gpu.attention_seconds(hw, spec, t, b, s, c, peak, unfused)
        return fwd * passes + bwd

    if not hw.kernel_model:  # one rate: QK^T and AV, 4·s·H·hd FLOPs per token and layer
        # forward (2x backward), causal: n - 1 more triangles of the local length
        flops = 4.0 * s * spec.q_dim / t * b * s / 2 * (passes + 2)
        return (n - 1) * flops / hw.flops(job.precision)
    fused = core(job.bc, hw.peak[job.precision], peers.of(job).unfused_attention)
    if mode == "ring" and not peers.of(job).cp_fused_blocks:
        # ours: each block pair's scores in fp32 matmuls and element-wise passes
        # (parallel/context_comm.py), the rank's own pair whole and, with the zig-zag split,
        # half of each of the n - 1 others: (n + 1) / 2 local squares, for the fused one
        # the equivalent priced
        return (n + 1) / 2 * core(4, hw.peak["fp32"], True) - fused
    # fused kernels (Ulysses' SDPA over the whole length for 1/n of the heads, or a peer's
    # flash blocks): 1/n of the whole triangle = n local ones
    return (n - 1) * fused


def _link(job: Job, asked: Layout) -> float:
    """Bytes/s of the cp group's slowest link: cp runs of tp-wide ranks, in one node while
    cp x tp devices fit there, else through each rank's own NIC."""
    hw = job.hardware
    bw = hw.intra_bw if asked.cp * asked.tp <= hw.per_node else min(hw.intra_bw, hw.inter_bw)
    return bw * hw.comm_eff


def cp_seconds(
    whole: Job,
    asked: Layout,
    job: Job,
    layout: Layout,
    kinds: dict[str, float],
    calls: int,
    parts: dict[str, float],
) -> dict[str, float]:
    """Seconds per step that cp adds to `parts` (tm.step_time of the data-parallel equivalent
    `job`/`layout` of the cp layout `asked` of `whole`): `cp_attention_s` (the attention over
    the rest of the sequence, bubble included), `cp_comm_s` (the exchange of `kinds`/`calls`,
    traffic.cp_traffic), `cp_exposed_s` (what of it no computation hides)."""
    hw, n = job.hardware, asked.cp
    if n == 1:
        return {}
    m = layout.micro_batches(job)
    slowdown = hw.slowdown(job.devices)
    layers = -(-whole.spec.n_layers // asked.pp)  # the busiest stage's
    # one micro-batch's added attention: the ring's steps after the first, behind which the
    # next block's sends travel
    extra = slowdown * layers * _attention_seconds(job, layout, asked.cp_mode, n)
    t_mb = parts["compute_s"] / m
    bubble_units = parts["bubble_s"] / t_mb if t_mb else 0.0
    gather = kinds.get("all_gather", 0.0)
    exchange = sum(kinds.values()) - gather
    # calls per step: one positions' all-gather per forward, the rest carry the blocks
    comm = slowdown * ((gather + exchange) / _link(job, asked) + calls * hw.latency)
    if asked.cp_mode == "ring":  # behind the attention of the block in hand (all of it now)
        hidden_part = exchange / (gather + exchange) if gather + exchange else 0.0
        hidden = min(comm * hidden_part, hw.overlap * m * extra)
    else:
        hidden = 0.0
    return {
        "cp_attention_s": extra * (m + bubble_units),
        "cp_comm_s": comm,
        "cp_exposed_s": comm - hidden,
    }
