"""What a pipeline rank holds chunk by chunk: the blocks of each of its model chunks, as the
engine cuts them (parallel/pipeline_split.plan_chunks), and the peak of saved activations
the interleaved schedule's order of those chunks' passes reaches (parallel/schedules.py)."""

from __future__ import annotations

from functools import lru_cache

from shardwise.models import ModelSpec
from shardwise.parallel.schedules import Pass, build_plan
from shardwise.plan.layout import Job, Layout


@lru_cache(maxsize=4096)
def chunk_blocks(
    spec: ModelSpec, p: int, v: int, seq_len: int, split: str = ""
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per pipeline rank, the block indices of each chunk it holds, in its local order k
    (global chunk k·p + r: Megatron's placement), as parallel/pipeline_split.plan_chunks
    cuts them (`split` when given, else balanced by parameters and FLOPs)."""
    if p == 1:
        return ((tuple(range(spec.n_layers)),),)
    from shardwise.parallel.pipeline_split import plan_chunks

    chunks = sorted(plan_chunks(spec, p, v, split, seq_len), key=lambda c: c.index)
    return tuple(tuple(c.blocks for c in chunks if c.index % p == r) for r in range(p))


def stage_blocks(job: Job, layout: Layout, stage: int | None) -> tuple[int, ...] | None:
    """The indices of the blocks pipeline rank `stage` holds (`chunk_blocks`); None for no
    stage (the step time's busiest stage, which is priced by count)."""
    if stage is None:
        return None
    cut = chunk_blocks(job.spec, layout.pp, layout.pp_virtual, job.seq_len, job.pp_split)
    return tuple(i for blocks in cut[stage] for i in blocks)


def interleaved_bytes(job: Job, layout: Layout, stage: int, block: float, edge: float) -> float:
    """Interleaved 1F1B's peak on pipeline rank `stage`: each chunk saves `block` bytes a block
    and the end it holds (the first chunk's embedding, the last one's head) its `edge`."""
    p, v = layout.pp, layout.pp_virtual
    cut = chunk_blocks(job.spec, p, v, job.seq_len, job.pp_split)[stage]
    front, tail = (edge if stage == 0 else 0.0), (edge if stage == p - 1 else 0.0)
    chunks = [block * len(c) for c in cut]
    return interleaved_held(p, layout.micro_batches(job), v, stage, chunks, front, tail)


def interleaved_held(
    p: int, m: int, v: int, stage: int, chunks: list[float], front: float, tail: float
) -> float:
    """`interleaved_peak` of a rank whose chunk k saves `chunks[k]` bytes a micro-batch, its
    first chunk also `front` (the first stage's embedding: a later stage's received input saves
    nothing before its blocks) and its last chunk `tail` (the last stage's head and loss)."""
    per_chunk = list(chunks)
    per_chunk[0] += front
    per_chunk[-1] += tail
    return interleaved_peak(p, m, v, stage, tuple(per_chunk))


def interleaved_peak(p: int, m: int, v: int, stage: int, chunk_bytes: tuple[float, ...]) -> float:
    """Peak bytes saved for backward on pipeline rank `stage` of interleaved 1F1B, its local
    chunk k saving `chunk_bytes[k]` per micro-batch: the most its held forwards add up to in
    the engine's order of passes (parallel/schedules.interleaved; a backward frees its
    forward's). The mix of chunks held matters where they differ (the first chunk's token
    ids, the last one's loss, uneven blocks): the first stage's peak at m = 2p holds 4 of its
    first chunk and 1 of its second at p = 2, 8 and 3 at p = 4."""
    # the steady state repeats every p·v passes: m beyond 3p (a multiple of p, as the
    # schedule requires) reaches no new peak, so the replay is cut there
    short = 3 * p if m > 3 * p and m % p == 0 else m
    return _replayed_peak(p, short, v, stage, tuple(chunk_bytes))


@lru_cache(maxsize=4096)
def _replayed_peak(p: int, m: int, v: int, stage: int, chunk_bytes: tuple[float, ...]) -> float:
    """`interleaved_peak` by replaying rank `stage`'s plan of m micro-batches."""
    held = peak = 0.0
    for chunk, sign in _passes(p, m, v)[stage]:
        held += sign * chunk_bytes[chunk]
        peak = max(peak, held)
    return peak


@lru_cache(maxsize=256)
def _passes(p: int, m: int, v: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rank, its interleaved passes in order as (local chunk, +1 forward / -1 backward):
    built once per (p, m, v), not per candidate (a search prices thousands whose chunks'
    bytes differ and whose schedules repeat)."""
    plan = build_plan("interleaved", p, m, v)
    return tuple(tuple((a.chunk, 1 if a.kind is Pass.F else -1) for a in rank) for rank in plan)
