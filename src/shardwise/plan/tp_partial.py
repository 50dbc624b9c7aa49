"""The gradients summed over tp (plan/traffic.py's partial all-reduce), and the MoE layers a tp
rank runs whole on its sequence shard: of the blocks a pipeline stage really holds (their
indices, plan/stage_chunks.py, as the engine cuts them), or of the step time's busiest stage
by count."""

from __future__ import annotations

from shardwise.models.families import family_of
from shardwise.models.moe import is_moe_block
from shardwise.plan.layout import Job, Layout
from shardwise.plan.lora_traffic import lora_partial


def moe_layers_of(job: Job, layers: int, blocks: tuple[int, ...] | None) -> int:
    """MoE blocks (models/moe.py: blocks moe_every-1, 2·moe_every-1, ...) among the `blocks`
    a stage holds, by their indices; with None among `layers` blocks by count."""
    spec = job.spec
    if spec is None or not spec.n_experts:
        return 0
    if blocks is None:
        return layers // spec.moe_every
    return sum(is_moe_block(spec, i) for i in blocks)


def moe_tp_layers(
    job: Job, layout: Layout, layers: int, blocks: tuple[int, ...] | None = None
) -> int:
    """MoE layers a tp rank of a pipeline stage holding `layers` blocks (`blocks`: their
    indices, `moe_layers_of`) runs on its sequence shard (tp > 1 with sp); 0 otherwise."""
    spec = job.spec
    if layout.tp == 1 or not layout.sp or spec is None or not spec.n_experts:
        return 0
    return moe_layers_of(job, layers, blocks)


def moe_partial(spec, ep: int, moe_layers: int) -> int:
    """Elements of an MoE decoder's `moe_layers` MoE layers whole on every tp rank, each
    seeing its sequence shard: the routers, the shared experts and, without ep, the experts
    (with ep they are reduced over their edp group, which holds the tp ranks, under dp)."""
    per_layer = spec.n_experts * spec.dim
    per_layer += 3 * spec.dim * spec.ffn_dim * spec.n_shared_experts
    per_layer += 3 * spec.n_experts * spec.dim * spec.ffn_dim if ep == 1 else 0
    return moe_layers * per_layer


def partial_of(held: tuple[int, bool, bool], stage: int | None) -> tuple[int, bool, bool] | None:
    """What `tp_partial` counts for `stage`: what it holds; the whole model for the step
    time's busiest stage (stage None: an upper bound, whichever stage that is)."""
    return None if stage is None else held


def tp_partial(
    job: Job,
    t: int,
    sp: bool,
    ep: int = 1,
    held: tuple[int, bool, bool] | None = None,
    blocks: tuple[int, ...] | None = None,
) -> int:
    """Elements of replicated parameters whose gradients are all-reduced over tp, of a stage
    `held` = (blocks, embedding, head) (default: the whole model), `blocks` the indices of
    its blocks (default: counted, `moe_layers_of`): with sp the norms (and GPT-2's
    row-layer biases and positions) saw only a sequence chunk; kv heads shared by several
    ranks' query heads (t > kv) and per-head q/k norms (`spec.qk_norm`) always; with sp an
    MoE layer's whole parameters (`moe_partial`). LoRA: the adapters only, the rest being
    frozen (lora_traffic.lora_partial, of the stage's blocks)."""
    spec, out = job.spec, 0
    layers, first, last = (spec.n_layers, True, True) if held is None else held
    if job.finetune.lora:
        return lora_partial(job, blocks)
    if sp and spec.n_experts:
        out += moe_partial(spec, ep, moe_layers_of(job, layers, blocks))
    if sp:
        norms = (2 * layers + last) * spec.dim  # each block's two, the final one
        block = family_of(spec).block
        out += norms * (2 if block.layer_norm else 1)
        if block.biases:  # the row-parallel linears' replicated biases
            out += 2 * layers * spec.dim
        if block.learned_positions and first:
            out += spec.max_seq_len * spec.dim
    if spec.n_kv_heads % t:  # each rank keeps the whole k and v projections (plan/shapes.py)
        out += 2 * layers * spec.n_kv_heads * spec.head_dim * spec.dim
    if spec.qk_norm:  # each rank's per-head q and k norms saw its own heads only
        out += 2 * layers * spec.head_dim
    return out
