"""`checkpoint.resume=DIR` where DIR is a torchtitan step checkpoint: continue a torchtitan run.

torchtitan saves `{"model": ..., "optimizer": ..., "lr_scheduler": ..., "dataloader": ...,
"train_state": ...}` with torch.distributed.checkpoint (DCP), which flattens the nesting: its
Llama weights under their names (flat or under "model."), and AdamW's state as
`get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)` writes it:
`optimizer.state.<param>.exp_avg`, `.exp_avg_sq`, `.step` and `optimizer.param_groups.<param>.lr`
and the like. Weights and both moments map to our names through models/dcp.py's table (q/k
rows, and their moments row for row, from Meta's RoPE order to ours), the step count from the
optimizer's `step`. A DCP directory without our index.json is taken as one.

Each rank reads whole tensors, one parameter's weight and moments at a time, and keeps the
slices it holds in the current layout (a ZeRO span, a tensor-parallel box), so any layout
continues it. What torchtitan keeps and we cannot use is said in one line at start: its data
loader position (our data order is a function of (seed, global sample index)), its lr
scheduler and its param groups' hyper-parameters (this config's schedule and AdamW settings
apply from the resumed step).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.checkpoint import io as io
from shardwise.checkpoint.refusals import every_rank
from shardwise.checkpoint.state import PER_RANK, Local, finish_load, local_state
from shardwise.errors import CheckpointError, ConfigError
from shardwise.models.dcp import from_meta_rope, is_dcp, tensor_sizes, titan_name

STATE = "optimizer.state."  # get_optimizer_state_dict's flattened keys, under "optimizer"
MOMENTS = ("exp_avg", "exp_avg_sq")
KEY = "checkpoint.resume"


def is_titan(path: str | Path) -> bool:
    """Whether `path` is a DCP directory that is not one of our step directories."""
    return is_dcp(path) and not (Path(path) / io.INDEX).is_file()


@dataclass
class TitanLayout:
    """What a torchtitan step checkpoint holds, under our keys (`param/NAME`, `exp_avg/NAME`,
    `exp_avg_sq/NAME`): each one's stored key, whether its rows are in Meta's RoPE order, and
    every tensor's shape and dtype."""

    path: Path
    sizes: dict[str, tuple[torch.Size, torch.dtype]]
    keys: dict[str, tuple[str, bool]]
    steps: list[str]  # the optimizer's per-parameter `step` tensors


def read_layout(path: str | Path) -> TitanLayout:
    """The checkpoint's keys mapped to ours, from its metadata alone."""
    path = Path(path)
    try:
        sizes = tensor_sizes(path, KEY)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    keys: dict[str, tuple[str, bool]] = {}
    steps = []
    for key in sizes:
        if key.startswith(STATE):
            fqn, _, kind = key[len(STATE) :].rpartition(".")
            mapped = titan_name(fqn)
            if kind == "step":
                steps.append(key)
            elif mapped and kind in MOMENTS:
                keys[f"{kind}/{mapped[0]}"] = (key, mapped[1])
        elif (mapped := titan_name(key)) is not None:
            keys[f"param/{mapped[0]}"] = (key, mapped[1])
    return TitanLayout(path, sizes, keys, steps)


def _source(key: str) -> str:
    """The torchtitan tensor our slice `key` is read from: a master copy is the weight."""
    kind, name = key.split("/", 1)
    return f"param/{name}" if kind == "master" else key


def problems(layout: TitanLayout, wanted: dict[str, tuple[int, ...]]) -> list[str]:
    """What keeps `wanted` (our key -> full shape) from being read out of the checkpoint:
    missing tensors, other shapes, and torchtitan weights this model has no place for."""
    out = []
    # parameters first: they say what differs; their moments follow suit
    for key, shape in sorted(wanted.items(), key=lambda kv: (not kv[0].startswith("param/"), kv)):
        src = layout.keys.get(_source(key))
        if src is None:
            out.append(f"no tensor for {key}")
        elif tuple(layout.sizes[src[0]][0]) != tuple(shape):
            got = list(layout.sizes[src[0]][0])
            out.append(f"'{src[0]}' has shape {got}, {key} is {list(shape)}")
    needed = {_source(k) for k in wanted}
    out += [
        f"'{layout.keys[k][0]}' has no place in this model"
        for k in sorted(layout.keys)
        if k.startswith("param/") and k not in needed
    ]
    return out


def refusal(layout: TitanLayout, wanted: dict[str, tuple[int, ...]], arch: str) -> str | None:
    """One line saying why this run cannot continue the checkpoint (None: it can)."""
    path = layout.path
    if not any(k.startswith(STATE) for k in layout.sizes):
        return _no_optimizer(path)
    found = problems(layout, wanted)
    if found:
        return (
            f"{KEY}={path} (a torchtitan checkpoint) does not fit model.name's {arch} model: "
            + "; ".join(found[:6])
            + (f" (and {len(found) - 6} more)" if len(found) > 6 else "")
            + ". Fix: set model.name and model.* to the checkpoint's shape (a DCP holds no "
            "config)."
        )
    return None


def _no_optimizer(path: Path) -> str:
    return (
        f"{KEY}={path} is a DCP checkpoint without optimizer state (no '{STATE}*' "
        "tensors): a resume continues AdamW's moments and step count, which it does not "
        f"hold. Fix: start from its weights with --model.init_from={path} (fresh AdamW "
        f"state from step 0) instead of --{KEY}."
    )


def _read(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill `tensors` (stored key -> buffer of its full shape) in this process alone."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming ... a single process": each rank reads alone
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(tensors, checkpoint_id=str(path), no_dist=True)


def read_step(layout: TitanLayout) -> int:
    """AdamW's step count: every parameter's `step`, which must agree."""
    if not any(k.startswith(STATE) for k in layout.sizes):
        raise CheckpointError(_no_optimizer(layout.path))
    if not layout.steps:
        raise CheckpointError(
            f"{KEY}={layout.path} has optimizer state but no 'step' tensors: AdamW's bias "
            f"correction cannot continue. Fix: start from its weights with "
            f"--model.init_from={layout.path} instead of --{KEY}."
        )
    steps = {k: torch.empty(layout.sizes[k][0], dtype=layout.sizes[k][1]) for k in layout.steps}
    _read(layout.path, steps)
    counts = sorted({int(v.item()) for v in steps.values()})
    if len(counts) > 1:  # one count for all tensors is what our AdamW keeps
        raise CheckpointError(
            f"{KEY}={layout.path}: its AdamW step counts differ between parameters "
            f"({counts}). Fix: start from its weights with --model.init_from={layout.path}."
        )
    return counts[0]


def _full(layout: TitanLayout, keys: list[str], spec) -> dict[str, torch.Tensor]:
    """The stored tensors behind our `keys`, at full shape, rows in our RoPE order, read in
    one dcp.load (each call reads the checkpoint's metadata again)."""
    out = {}
    for key in keys:
        src = layout.keys[key][0]
        out[src] = torch.empty(layout.sizes[src][0], dtype=layout.sizes[src][1])
    _read(layout.path, out)
    full = {}
    for key in keys:
        src, meta_order = layout.keys[key]
        full[key] = out[src]
        if meta_order:
            heads = spec.n_heads if ".wq." in key else spec.n_kv_heads
            full[key] = from_meta_rope(out[src], heads)
    return full


def _fill(local: Local, full: torch.Tensor) -> None:
    """Write `local`'s elements (its box of `full`, then its flat span) into its memory."""
    piece = local.piece
    box = full[tuple(slice(o, o + n) for o, n in piece.box)].reshape(-1)
    local.load(lambda dst: dst.copy_(box[piece.span[0] : piece.span[1]]))


def wanted_of(locals_: list[Local]) -> dict[str, tuple[int, ...]]:
    """Our keys (with full shapes) of the slices `locals_`."""
    return {lo.piece.key: lo.piece.shape for lo in locals_}


@torch.no_grad()
def load_titan(run, path: Path, channel) -> tuple[int, str]:
    """Fill this rank's slices from the torchtitan checkpoint at `path`; returns the step to
    continue from (AdamW's step count) and the line saying what was not carried. Every rank
    raises the same message if it does not fit (collective over `channel`)."""
    from shardwise.models.init import find_spec

    spec = find_spec(run.model)
    try:  # every rank reads the same metadata and values: the same message, printed once
        layout = read_layout(path)
        step = read_step(layout)
    except CheckpointError as exc:
        raise every_rank(exc) from None
    run.optimizer.fresh_state(step)  # the moments exist from here: list the slices after it
    locals_ = [lo for lo in local_state(run) if not lo.piece.key.startswith(PER_RANK)]
    # a torchtitan checkpoint holds none of our buffers: they keep their initial values
    locals_ = [lo for lo in locals_ if not lo.piece.key.startswith("buffer/")]
    wanted = {k: s for got in channel.all_gather(wanted_of(locals_)) for k, s in got.items()}
    why = refusal(layout, wanted, spec.arch)
    if why:  # every rank has the same union of slices and the same metadata
        raise every_rank(CheckpointError(why))
    by_name: dict[str, list[Local]] = {}  # a parameter's weight and moments read together
    for local in locals_:
        by_name.setdefault(local.piece.key.split("/", 1)[1], []).append(local)
    for here in by_name.values():  # one parameter's whole tensors in memory at a time
        full = _full(layout, sorted({_source(lo.piece.key) for lo in here}), spec)
        for local in here:
            _fill(local, full[_source(local.piece.key)])
    finish_load(run, locals_)
    return step, not_carried(run.cfg, step)


def not_carried(cfg, step: int) -> str:
    """The line a resume from torchtitan prints: what of its run does not continue."""
    from shardwise.optim import lr_at

    return (
        f"from torchtitan: weights and AdamW moments at its optimizer step {step}; not carried: "
        "its data loader position (data follows this run's order from sample "
        f"{step * cfg.train.global_batch}), its lr scheduler and param groups (this config's "
        f"schedule and AdamW settings: lr {lr_at(step, cfg):.3g} at step {step})"
    )
