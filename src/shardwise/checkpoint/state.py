"""What a rank holds of a run's state, who writes which slice, and loading it back in any
layout (the format is in checkpoint_io; when to save and resume is in checkpoint).

* **What a rank holds** (`local_state`): its slices of parameters, fp32 masters and AdamW
  moments — whole tensors under data parallelism, flat pieces under ZeRO, boxes under
  tensor parallelism — and the persistent buffers, each keyed by its global name.
* **Who writes what** (`assign_writers`): the ranks exchange these lists (a few hundred
  bytes per tensor) over a side channel; a slice held by one rank is written by it, a slice
  replicated on several (data parallelism) by the least-loaded holder, largest first. So
  every rank writes only what it owns, in parallel, into its own file; nothing is gathered.
* **Loading** (`load_state`) lists the same slices for the *current* layout and reads, from
  the stored slices, exactly the elements each one needs; whether the checkpoint fits this run
  at all is checkpoint/refusals.py's question.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.checkpoint import io as io
from shardwise.checkpoint import slices
from shardwise.checkpoint.refusals import (
    every_rank,
    identity_problems,
    mismatch_message,
    run_identity,
)
from shardwise.distributed.comm import ControlChannel
from shardwise.errors import CheckpointError
from shardwise.models.init import canonical_name, find_spec, persistent_named_buffers
from shardwise.optim import MixedPrecisionAdamW, lr_at
from shardwise.parallel.compress import PowerSGD
from shardwise.parallel.zero import ZeroEngine

# kinds of state that belong to one rank, not to the model (`_per_rank`): keyed
# `<kind>/rank<r>/...`, restored only into the layout that saved them
PER_RANK = ("powersgd_error", "powersgd_q", "powersgd_rng")


@dataclass
class Local:
    """One stored slice this rank holds: its description and where its values live."""

    piece: io.Piece
    tensor: torch.Tensor  # flat view of the memory holding the values
    where: torch.Tensor | None = None  # their positions in `tensor` (None: all, in order)
    after_load: Callable[[], None] | None = None  # run once this slice is loaded

    def values(self) -> torch.Tensor:
        return self.tensor if self.where is None else self.tensor[self.where]

    def load(self, fill) -> None:
        """`fill(dst)` writes the slice's elements, in order, into the flat `dst`."""
        if self.where is None:
            fill(self.tensor)
            return
        dst = torch.empty(self.piece.numel, dtype=self.tensor.dtype, device=self.tensor.device)
        fill(dst)
        self.tensor[self.where] = dst


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("checkpointed tensors must be contiguous (loading writes in place)")
    return t.detach().view(-1)


def slices_of(key: str, p: torch.Tensor, span: tuple[int, int], values: torch.Tensor):
    """The stored slices of elements [span) of the flattened local tensor `p` (parameter,
    master or moment), whose values are `values` (flat, span's elements).

    Without tensor parallelism `p` is the whole tensor: one slice. A tensor-parallel shard
    (`p.tp_slice`, models/init.LocalSlice) is the concatenation along one dimension of
    ranges of the full tensor (three for a fused q|k|v weight; the last range of a
    vocabulary-parallel weight may run into padding, which is not stored): each range is a
    box, and the span's elements inside a box are a contiguous run of that box's row-major
    order — at strided places of `values` unless the split dimension is the first."""
    dtype = io.dtype_name(values.dtype)
    cut = getattr(p, "tp_slice", None)
    if cut is None:
        return [Local(io.Piece(key, tuple(p.shape), dtype, io.full_box(p.shape), span), values)]
    out, at = [], 0
    local = torch.arange(p.numel()).view(p.shape)
    for a, b in cut.ranges:
        real = min(b, cut.full_shape[cut.dim]) - a  # rows past the real size are padding
        if real > 0:
            idx = local.narrow(cut.dim, at, real).reshape(-1)
            keep = (idx >= span[0]) & (idx < span[1])
            count = int(keep.sum())
            if count:
                first = int(keep.int().argmax())
                if not bool(keep[first : first + count].all()):  # see the docstring
                    raise AssertionError(f"{key}: a span cuts a box into pieces")
                box = list(io.full_box(cut.full_shape))
                box[cut.dim] = (a, real)
                piece = io.Piece(key, cut.full_shape, dtype, tuple(box), (first, first + count))
                pos = idx[keep] - span[0]
                if int(pos[-1] - pos[0]) + 1 == count:  # contiguous: a view, no index
                    out.append(Local(piece, values[int(pos[0]) : int(pos[0]) + count]))
                else:
                    out.append(Local(piece, values, pos))
        at += b - a
    return out


def local_state(run) -> list[Local]:
    """Every slice of model and optimizer state this rank holds, in a fixed order. A tied
    head held by the last pipeline stage is stored under its one name, `embed.weight`."""
    out, params = [], {}
    spec = find_spec(run.model)
    key = lambda name: canonical_name(name, spec)  # noqa: E731
    if isinstance(run.reducer, ZeroEngine):
        for unit in run.reducer.units:
            for name, p, start, stop, at in unit.pieces():
                params[name] = p
                values = unit.shard[at : at + stop - start]
                out += slices_of(f"param/{key(name)}", p, (start, stop), _flat(values))
    else:
        for name, p in run.model.named_parameters():
            params[name] = p
            out += slices_of(f"param/{key(name)}", p, (0, p.numel()), _flat(p))
    opt: MixedPrecisionAdamW = run.optimizer
    for t, m in zip(opt.targets, opt.masters, strict=True):
        span, p = t.span or (0, m.numel()), params[t.name]
        if opt.separate_master:
            out += slices_of(f"master/{key(t.name)}", p, span, _flat(m))
        moments = opt.moments(m)  # fp32 for any optimizer (8-bit: dequantised copies)
        for kind, v in moments.items():
            out += slices_of(f"{kind}/{key(t.name)}", p, span, _flat(v))
        if opt.quantised(m):  # 8-bit: requantised after the load
            out[-1].after_load = lambda m=m, v=moments: opt.store_moments(m, v)
    for name, b in persistent_named_buffers(run.model):
        out += slices_of(f"buffer/{name}", b, (0, b.numel()), _flat(b))
    return out + _per_rank(run)


def _whole(key: str, t: torch.Tensor, after_load=None) -> Local:
    piece = io.Piece(
        key, tuple(t.shape), io.dtype_name(t.dtype), io.full_box(t.shape), (0, t.numel())
    )
    return Local(piece, _flat(t), after_load=after_load)


def _per_rank(run) -> list[Local]:
    """State that belongs to this rank, not to the model (PowerSGD's error memory, warm-start
    Q and random stream): one tensor per rank, keyed `<kind>/rank<r>/...`, restored only into
    the layout that saved it (`_restorable`)."""
    compression = getattr(run.reducer, "compression", None)
    if not isinstance(compression, PowerSGD) or not run.cfg.checkpoint.per_rank_state:
        return []
    names = {id(p): n for n, p in run.model.named_parameters()}
    tag = f"rank{run.topo.rank}"
    out = [
        _whole(f"powersgd_{kind}/{tag}/{names[id(p)]}", t)
        for kind, p, t in compression.per_rank_state(run.reducer.buckets)
    ]
    rng = compression.generator.get_state()
    out.append(_whole(f"{PER_RANK[-1]}/{tag}", rng, lambda: compression.generator.set_state(rng)))
    return out


def adam_step(opt: MixedPrecisionAdamW) -> int:
    """AdamW's step count (the same for every tensor: a skipped step skips them all)."""
    return opt.adam_steps()


def assign_writers(held: list[list[io.Piece]]) -> dict[io.Piece, int]:
    """One writer per distinct slice (`held[rank]` lists what each rank holds): replicas go
    to the holder with the fewest bytes so far, largest slices first (deterministic, so every
    rank computes the same plan)."""
    holders: dict[io.Piece, list[int]] = {}
    for rank, pieces in enumerate(held):
        for piece in pieces:
            holders.setdefault(piece, []).append(rank)
    load = [0] * len(held)
    owner = {}
    for piece in sorted(holders, key=lambda p: (-p.numel, p.key, p.box, p.span)):
        rank = min(holders[piece], key=lambda r: (load[r], r))
        owner[piece] = rank
        load[rank] += piece.numel
    return owner


def loop_state(run, step: int, adam: int) -> dict:
    """Everything besides tensors that the next step depends on."""
    cfg, scaler = run.cfg, run.optimizer.scaler
    return {
        "step": step,
        # the data cursor: the sampler is a function of (seed, global sample position)
        "data": {
            "seed": cfg.train.seed,
            "global_batch": cfg.train.global_batch,
            "position": step * cfg.train.global_batch,
        },
        "lr_schedule": {"step": step, "next_lr": lr_at(step, cfg)},
        "loss_scaler": {
            "enabled": scaler.enabled,
            "scale": scaler.scale,
            "good_steps": scaler.good_steps,
        },
        "optimizer": {"adam_step": adam},
        # initialisation is a function of (seed, name), random streams of (seed, step, ...)
        "seeds": {"train": cfg.train.seed},
    }


def build_index(run, step: int, owner: dict[io.Piece, int], adam: int) -> dict:
    tensors: dict[str, dict] = {}
    for piece, rank in sorted(owner.items(), key=lambda kv: (kv[0].key, kv[0].box, kv[0].span)):
        entry = tensors.setdefault(
            piece.key, {"shape": list(piece.shape), "dtype": piece.dtype, "slices": []}
        )
        entry["slices"].append(
            {
                "file": io.shard_name(rank),
                "key": io.file_key(piece),
                "box": [list(b) for b in piece.box],
                "span": list(piece.span),
            }
        )
    d = run.derived
    return {
        "format": io.FORMAT,
        "version": io.VERSION,
        "step": step,
        "config": run.cfg.to_dict(),
        "layout": {
            "world": d.world,
            "pp": d.pp,
            "dp": d.dp,
            "cp": d.cp,  # ranks splitting each sample's sequence (dp: the sample streams)
            "ep": d.ep,  # ranks splitting each MoE layer's experts (stored whole regardless)
            "tp": d.tp,
            "zero": run.cfg.parallel.zero,
            "compute": run.cfg.precision.compute,
        },
        "loop": loop_state(run, step, adam),
        "identity": run_identity(run),
        "files": {},
        "tensors": tensors,
    }


# -- loading ------------------------------------------------------------------------------------
def _source(index: dict, piece: io.Piece) -> str | None:
    """The stored tensor a slice is read from. fp32 values come from the masters when the
    checkpoint has them (a bf16 run's truth), low-precision parameters from their own
    stored copy; either falls back to the other, so precision may change on resume."""
    kind, name = piece.key.split("/", 1)
    order = [kind]
    if kind in ("param", "master"):
        order = ["master", "param"] if piece.dtype == "float32" else ["param", "master"]
    return next((f"{k}/{name}" for k in order if f"{k}/{name}" in index["tensors"]), None)


def _fit_problems(index: dict, locals_: list[Local]) -> list[tuple[str, str]]:
    """(kind, text) for every slice this rank needs that the checkpoint lacks or shapes
    differently."""
    problems = []
    for local in locals_:
        src = _source(index, local.piece)
        if src is None:
            problems.append(("missing", local.piece.key))
        elif tuple(index["tensors"][src]["shape"]) != local.piece.shape:
            saved = tuple(index["tensors"][src]["shape"])
            problems.append(("shape", f"{local.piece.key} {saved} saved, {local.piece.shape} here"))
    return problems


def _restorable(index: dict, run, own: list[Local]) -> bool:
    """Whether this rank's own state (`_per_rank`) can be read back: saved by the same layout
    (rank r then is the same place in the mesh) with the same shapes."""
    d, was = run.derived, index["layout"]
    same = all(was[k] == getattr(d, k) for k in ("world", "dp", "tp", "pp"))
    return bool(own) and same and not _fit_problems(index, own)


@torch.no_grad()
def load_state(run, path: Path, index: dict, channel: ControlChannel) -> str | None:
    """Fill this rank's slices (in its current layout) from the checkpoint at `path`; every
    rank raises the same one message if tensors are missing, extra or of another shape.
    Returns a note when per-rank state (PowerSGD's) restarts instead of being restored."""
    adam = index["loop"]["optimizer"]["adam_step"]
    if adam:
        run.optimizer.fresh_state(adam)
    locals_ = local_state(run)
    own = [lo for lo in locals_ if lo.piece.key.startswith(PER_RANK)]
    locals_ = [lo for lo in locals_ if not lo.piece.key.startswith(PER_RANK)]
    names = {lo.piece.key for lo in locals_ if lo.piece.key.startswith("param/")}
    refusal, changed = identity_problems(run, index, path)
    gathered = channel.all_gather(
        (_fit_problems(index, locals_), names, _restorable(index, run, own), bool(own), refusal)
    )
    refusals = [g[4] for g in gathered if g[4]]
    if refusals:  # every rank raises the same message (printed once)
        raise every_rank(CheckpointError(refusals[0]))
    note = None
    if all(g[2] for g in gathered):
        locals_ += own
    elif any(g[3] for g in gathered):
        was = index["layout"]
        note = (
            "PowerSGD's error memory and warm-start Q start afresh: they are per-rank state, "
            "restored only into the layout that saved them (world "
            f"{was['world']} dp {was['dp']} tp {was['tp']} pp {was['pp']}) from a checkpoint "
            "that has them (checkpoint.per_rank_state=true, the default, from 2026-11-26 on)"
        )
    problems = [p for g in gathered for p in g[0]]
    needed = set().union(*(g[1] for g in gathered))
    problems += [
        ("extra", k) for k in index["tensors"] if k.startswith("param/") and k not in needed
    ]
    if problems:  # gathered: every rank raises the same message (printed once)
        raise every_rank(CheckpointError(mismatch_message(path, problems, run.cfg, index)))
    if index.get("storage") == "dcp":  # torch.distributed.checkpoint files (dcp_format.py)
        _load_dcp(run, path, index, locals_, channel)
    else:
        reader = slices.ShardReader(path)
        try:
            for local in locals_:
                src = _source(index, local.piece)
                need = dataclasses.replace(local.piece, key=src)
                local.load(
                    lambda dst, n=need, e=index["tensors"][src]: slices.load_piece(
                        dst, n, e, reader
                    )
                )
        finally:
            reader.close()
    finish_load(run, locals_)
    return "; ".join(n for n in (note, changed) if n) or None


def finish_load(run, locals_: list[Local]) -> None:
    """After every slice of `locals_` is filled: what derives from the loaded values."""
    for local in locals_:
        if local.after_load is not None:  # 8-bit moments: quantised from the loaded fp32
            local.after_load()
    if isinstance(run.reducer, ZeroEngine):
        run.reducer.after_step()  # ZeRO-1/2: publish the loaded slices to every replica


def _load_dcp(run, path: Path, index: dict, locals_: list[Local], channel) -> None:
    """Fill `locals_` from a DCP step directory in one collective dcp.load (resharding: DCP
    reads the stored chunks that overlap each slice)."""
    from shardwise.checkpoint import dcp_format

    # a slice held whole in host memory is read in place; others through a host buffer
    direct = [lo.where is None and lo.tensor.device.type == "cpu" for lo in locals_]
    bufs = [
        lo.tensor if here else torch.empty(lo.piece.numel, dtype=lo.tensor.dtype)
        for lo, here in zip(locals_, direct, strict=True)
    ]
    wanted = [(lo.piece, _source(index, lo.piece), b) for lo, b in zip(locals_, bufs, strict=True)]
    try:
        dcp_format.load(path, wanted, channel.group, run.topo.world)
    except OSError as exc:  # DCP raises it alike on every rank
        raise every_rank(
            CheckpointError(
                f"reading the DCP checkpoint {path} failed: {exc}. Fix: resume an earlier "
                "checkpoint with --checkpoint.resume=PATH, or restore this one's files."
            )
        ) from exc
    for local, buf, here in zip(locals_, bufs, direct, strict=True):
        if not here:
            local.load(lambda dst, b=buf: dst.copy_(b))
