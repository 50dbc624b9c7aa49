"""What a pipeline rank sends over pp per step (plan/traffic.py's pp entries): activations
forward and their gradients backward between its chunks and the next rank's (parallel/
pipeline.py), and the tied embedding/head gradient summed between the two ends."""

from __future__ import annotations

from shardwise.plan import memory as mem
from shardwise.plan import peers
from shardwise.plan.buffers import align_of, padded_numel
from shardwise.plan.layout import Job, Layout


def _sends(layout: Layout, stage: int | None) -> int:
    """Point-to-point sends per micro-batch of pipeline rank `stage` (None: the busiest): it
    sends forward from its v chunks (the last chunk's rank one fewer) and backward likewise
    (the first chunk's rank one fewer); with p = 2 each rank is one of those."""
    p, v = layout.pp, layout.pp_virtual
    if stage is None:
        return 2 * v - (1 if p == 2 else 0)
    return 2 * v - (stage == p - 1) - (stage == 0)


def _tied_sum(job: Job, layout: Layout, stage: int | None) -> float:
    """Bytes of the tied embedding/head gradient a rank sums with the other end of the
    pipeline (parallel/pipeline.py `_sync_tied`, an all-reduce over 2 ranks: its bytes once):
    its dp-reduced part, the whole of its vocabulary shard (ZeRO-0) or what of it lies in its
    ZeRO-1 slice (the embedding's unit is the first); 0 unless tied across stages, and for a
    middle stage."""
    p = layout.pp
    if p == 1 or not job.spec.tie_embeddings or stage not in (0, p - 1):
        return 0.0
    embed = mem.stage_units(job, layout, 0)[0]
    n = embed.entries[0][0]
    if layout.zero and layout.dp > 1:
        n = min(n, padded_numel(embed, layout.dp, align_of(job)) // layout.dp)
    return n * job.br


def pp_bytes(job: Job, layout: Layout, stage: int | None = None) -> float:
    """Bytes pipeline rank `stage` (None: the busiest, without the tied sum) sends over pp per
    step: activations forward and their gradients backward, per micro-batch and chunk."""
    if layout.pp == 1:
        return 0.0
    act = layout.micro_batch * job.seq_len * job.spec.dim * job.bc
    split = layout.sp or peers.of(job).pp_scatter_gather
    sent = layout.micro_batches(job) * act / (layout.tp if split else 1) * _sends(layout, stage)
    return sent + _tied_sum(job, layout, stage)


def pp_calls(job: Job, layout: Layout, stage: int | None) -> int:
    """Calls over pp per step of pipeline rank `stage` (None: the busiest), as comm.py counts
    them: one send per micro-batch and chunk boundary (as `pp_bytes`), plus the tied
    embedding/head gradient's all-reduce between the first and the last stage."""
    p = layout.pp
    if p == 1:
        return 0
    ends = stage is None or stage in (0, p - 1)
    tied = 1 if job.spec.tie_embeddings and ends else 0
    return layout.micro_batches(job) * _sends(layout, stage) + tied
