"""Mixture-of-experts blocks as the planner prices them (models/moe.py, parallel/expert.py).

A spec with `n_experts` has every `moe_every`-th block's MLP replaced by a router and
`n_experts` routed SwiGLU experts of `ffn_dim` each (each token to `top_k` of them), plus
`n_shared_experts` always-on ones; the other blocks and every attention are the dense
decoder's. What this module adds to the dense formulas:

- Model states: the stacked expert weights [E, d, f] in the MoE blocks' units (exact against
  the real model's units: tests/test_plan_moe.py), with LoRA on them their pairs
  (`adapter_entries`); under expert parallelism (`layout.ep`) both leave the dense units for
  units of their own holding E/ep experts, sharded and reduced over the (dp·cp/ep)·tp ranks
  that hold the same experts (memory.expert_group), as the engine does.
- Compute: the router GEMM [tokens, E] and the routed experts as a grouped GEMM priced as the
  routed rows' GEMMs, one kernel per expert group (each at the GEMM efficiency and the
  roofline of its own m x n x k); the shared experts as one dense SwiGLU; the permutation
  (gather into expert order, the score weighting, the combine) and the router's fp32 softmax
  and top-k as memory-bound kernels.
- Routing is assumed balanced and dropless (every expert receives top_k·tokens/E rows): the
  imbalance of an under-trained router is not priced, so a real step is at least this long.
- Expert parallelism's token exchange (traffic.ep_traffic's bytes and calls) at the ep group's
  link, all exposed: Megatron-Core's all-to-all dispatcher does not overlap it with
  computation by default, and neither does parallel/expert_comm.py.
- FLOPs for MFU: 6·N_active, N_active the non-embedding parameters less the routed experts a
  token is not sent to, (E - k)/E of them (as training/metrics.py counts them).
"""

from __future__ import annotations

from shardwise.models import ModelSpec
from shardwise.plan.shapes import (  # the MoE blocks' shapes live with the others'
    Unit,
    block_units,
    dense_spec,
    is_moe,
    linear_shapes,
    moe_block_entries,
    moe_blocks,
    non_embedding_params,
)

__all__ = [  # (the first five from shapes: callers ask this module)
    "EXPERT_WEIGHTS",
    "act_width",
    "active_params",
    "adapted_experts",
    "adapter_entries",
    "block_units",
    "dense_spec",
    "ep_seconds",
    "inactive_params",
    "is_expert_entry",
    "is_moe",
    "lora_gemms",
    "lora_shapes",
    "mlp_gemms",
    "moe_block_entries",
    "moe_blocks",
    "moe_share",
    "routing_bytes",
    "split_units",
]


def moe_share(spec: ModelSpec) -> float:
    """The fraction of blocks that are MoE blocks."""
    return moe_blocks(spec) / spec.n_layers if is_moe(spec) else 0.0


def inactive_params(spec: ModelSpec) -> int:
    """Routed expert parameters a token does not use: (E - k) of every MoE layer's E."""
    if not is_moe(spec):
        return 0
    per_expert = 3 * spec.dim * spec.ffn_dim  # gate, up and down
    return moe_blocks(spec) * (spec.n_experts - spec.top_k) * per_expert


def active_params(job) -> int:
    """Matmul parameters a token's forward uses: the job's (real or formula) non-embedding
    parameters less `inactive_params`."""
    spec = job.spec
    return (job.matmul_params or non_embedding_params(spec)) - inactive_params(spec)


def is_expert_entry(entry: tuple, spec: ModelSpec) -> bool:
    """Whether a unit entry is a stacked expert tensor (it carries its [E, ...] shape)."""
    shape = entry[2] if len(entry) > 2 else None
    return isinstance(shape, tuple) and len(shape) == 3 and shape[0] == spec.n_experts


def split_units(us: list[Unit], spec: ModelSpec, ep: int) -> tuple[list[Unit], list[Unit]]:
    """(dense units, expert units) of a rank under expert parallelism `ep`, as
    job/experts.expert_units splits the real model: each unit's stacked expert weights leave it
    for a unit of their own holding E/ep experts. ep = 1 (or no experts): (us, [])."""
    if ep == 1 or not is_moe(spec):
        return list(us), []
    dense, experts = [], []
    for u in us:
        kept = tuple(e for e in u.entries if not is_expert_entry(e, spec))
        split = tuple(
            (e[0] // ep, e[1], (e[2][0] // ep, *e[2][1:]), *e[3:])
            for e in u.entries
            if is_expert_entry(e, spec)
        )
        dense += [Unit(u.name, kept, u.count)] if kept else []
        experts += [Unit(f"{u.name}[experts]", split, u.count)] if split else []
    return dense, experts


def mlp_gemms(spec: ModelSpec, t: int, tokens: float, ep: int) -> list[tuple]:
    """(m, n, k) of an MoE block's MLP on one rank: the router, each local expert's grouped
    GEMM group (gate, up, down) over the rows routed to it, and the shared experts. Balanced,
    dropless routing: a rank's tokens·top_k rows land evenly on the E experts, so with E/ep
    experts here each receives tokens·top_k·ep/E rows (from every ep rank). A capacity factor
    computes its slots (ep = 1: padded to capacity; ep > 1: only kept rows travel). Under tp
    (with sp) the layer is whole on every tp rank and routes that rank's 1/t of the tokens."""
    h, f, e = spec.dim, spec.ffn_dim, spec.n_experts
    local, rows = _routed_rows(spec, t, tokens, ep)
    tokens = tokens / t
    out = [(tokens, e, h)]  # the router (replicated over tp)
    for _ in range(local):
        out += [(rows, f, h), (rows, f, h), (rows, h, f)]
    if spec.n_shared_experts:
        wide = f * spec.n_shared_experts
        out += [(tokens, wide, h), (tokens, wide, h), (tokens, h, wide)]
    return out


def _routed_rows(spec: ModelSpec, t: int, tokens: float, ep: int) -> tuple[int, float]:
    """(experts on this rank, rows each receives) under balanced routing (`mlp_gemms`)."""
    local = spec.n_experts // ep
    fill = spec.capacity_factor if spec.capacity_factor else 1.0
    if ep > 1:
        fill = min(fill, 1.0)
    return local, tokens / t * spec.top_k * fill / local


EXPERT_WEIGHTS = ("w1", "w3", "w2")  # models/moe.MoE's stacked weights, in forward order


def adapted_experts(names: list[str]) -> tuple[str, ...]:
    """The stacked expert weights LoRA target `names` (patterns' last parts) adapt
    (finetune/lora.expert_targets): `experts` all of them, else those named."""
    if "experts" in names:
        return EXPERT_WEIGHTS
    return tuple(w for w in EXPERT_WEIGHTS if w in names)


def lora_shapes(spec: ModelSpec, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(fan_in, fan_out) per linear LoRA can target on one tp rank (shapes.linear_shapes): an
    MoE spec's are its dense decoder's (attention, dense and shared MLPs) and the router
    [dim -> E], which the MoE layer keeps whole on every tp rank."""
    out = dict(linear_shapes(dense_spec(spec), tp))
    if is_moe(spec):
        out["router"] = (spec.dim, spec.n_experts)
    return out


def _expert_fans(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each stacked expert weight (models/moe.MoE: w1, w3 [E, dim, ffn], w2
    [E, ffn, dim])."""
    h, f = spec.dim, spec.ffn_dim
    return {"w1": (h, f), "w3": (h, f), "w2": (f, h)}


def adapter_entries(spec: ModelSpec, ft) -> list[tuple]:
    """The unit entries of one MoE block's expert adapters (models/expert_lora.py), in the
    engine's module order: A [E, r, in] of every adapted weight, then B [E, out, r] of each;
    trainable, in compute dtype, whole on every tp rank as the experts are, and carrying their
    3-D shape, so that `split_units` cuts them over ep with the weights they adapt."""
    leaves = ft.lora_experts if ft.lora and is_moe(spec) else ()
    e, r, fans = spec.n_experts, ft.lora_rank, _expert_fans(spec)
    a = [(e * r * fans[w][0], True, (e, r, fans[w][0])) for w in leaves]
    return a + [(e * fans[w][1] * r, True, (e, fans[w][1], r)) for w in leaves]


def lora_gemms(spec: ModelSpec, ft, t: int, tokens: float, ep: int, c: int) -> list[tuple]:
    """(m, n, k) of an MoE block's expert adapters in forward on one rank
    (models/expert_lora.adapter_delta): per local expert and adapted weight [in, out], its rows
    times Aᵀ [in, r], then times Bᵀ [r, out]: 2·rows·r·(in + out) FLOPs. The rank is padded
    to 16 bytes as adapter_delta pads it for torch._grouped_mm. Backward runs each twice (input
    and weight gradients: the adapters train even where the base is frozen)."""
    leaves = ft.lora_experts if ft.lora and is_moe(spec) else ()
    if not leaves:
        return []
    step = max(1, 16 // c)
    r = -(-ft.lora_rank // step) * step
    shapes = _expert_fans(spec)
    local, rows = _routed_rows(spec, t, tokens, ep)
    out = []
    for _ in range(local):
        for leaf in leaves:
            d_in, d_out = shapes[leaf]
            out += [(rows, r, d_in), (rows, d_out, r)]
    return out


def act_width(spec: ModelSpec) -> float:
    """The SwiGLU width per token an MLP's activation runs on: ffn_dim for a dense block;
    top_k routed rows of ffn_dim plus the shared experts' for an MoE block."""
    if not is_moe(spec):
        return spec.ffn_dim
    return spec.ffn_dim * (spec.top_k + spec.n_shared_experts)


def routing_bytes(spec: ModelSpec, tokens: float, c: int, backward: bool) -> tuple[float, int]:
    """(bytes, kernels) of an MoE block's memory-bound routing work beyond the dense block's
    (models/moe.py). Forward: the router's fp32 softmax (read, write) and top-k (read) over
    [tokens, E]; the rows gathered into expert order (read, write k·tokens·h), weighted by
    their scores (read, write) and summed back per token (read k·tokens·h, write tokens·h);
    the shared experts' output added (2 reads, 1 write). Backward: each of those in reverse:
    the combine's gradient gathered (read, write), the weighting's two gradients (read the
    gradient and the saved rows, write one; 3 passes), the gather's gradient summed per token
    (read k·tokens·h, write tokens·h), the softmax's (3 passes of [tokens, E] fp32)."""
    if not is_moe(spec):
        return 0.0, 0
    h, k, e = spec.dim, spec.top_k, spec.n_experts
    rows, flat, scores = k * tokens * h, tokens * h, tokens * e * 4
    shared = 3 * flat if spec.n_shared_experts else 0
    if backward:
        moved = c * (2 * rows + 3 * rows + rows + flat + shared) + 3 * scores
    else:
        moved = c * (2 * rows + 2 * rows + rows + flat + shared) + 3 * scores
    return moved, 6


def _ep_link(job, layout) -> float:
    """Bytes/s of the ep group's slowest link: ep runs of tp-wide ranks, in one node while
    ep x tp devices fit there, else through each rank's own NIC."""
    hw = job.hardware
    inside = layout.ep * layout.tp <= hw.per_node
    return (hw.intra_bw if inside else min(hw.intra_bw, hw.inter_bw)) * hw.comm_eff


def ep_seconds(job, layout, moved: float, calls: int) -> dict[str, float]:
    """Seconds per step of expert parallelism's token exchange (`moved` bytes in `calls`
    all-to-alls: traffic.ep_traffic), all exposed; {} at ep = 1."""
    if layout.ep == 1 or not moved:
        return {}
    hw = job.hardware
    slowdown = hw.slowdown(job.devices)
    cost = hw.collective_cost.get("all_to_all", 1.0)
    seconds = slowdown * (moved * cost / _ep_link(job, layout) + calls * hw.latency)
    return {"ep_comm_s": seconds, "ep_exposed_s": seconds}
