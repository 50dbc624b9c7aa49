"""Tensor parallelism (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022)
as a transformation of a plain model, driven by a plan that is data (`models/tp_plans.py`).

`apply_tensor_parallel` runs on the model while it is still on the meta device: each planned
module keeps its class and its parameter names, gets local-shaped parameters that remember
which slice of the full value they hold (`LocalSlice`, read by init and by the gather back
to full shape) and a forward with the conjugate operators of `tensor_comm`. Column-parallel
layers reading one input (q/k/v, gate/up) share one region entry on their parent, so each
block runs exactly one f/g pair (or all-gather/reduce-scatter pair) per attention and MLP.

Every parameter gets a `tp_kind` the optimizer reads: ``shard`` (disjoint over tp: squared
norms add up), ``replica`` (identical on every tp rank: counted once) or ``partial`` (each
rank holds a partial gradient — sequence-sharded norms, replicated kv heads — summed over tp
once per step, then a replica).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.distributed.comm import Comm
from shardwise.errors import ConfigError
from shardwise.finetune.lora import is_lora_layer
from shardwise.models.dropout import LayoutFreeDropout
from shardwise.models.init import LocalSlice
from shardwise.models.tp_plans import TPPlan, is_conv1d, out_dim
from shardwise.parallel.fp8 import fp8_matmul, is_fp8
from shardwise.parallel.tensor_comm import enter_tp, exit_tp, vocab_cross_entropy
from shardwise.parallel.tensor_lora import split_lora

COLUMNS = ("column", "column:kv", "column:qkv")


def keep_tp_marks(old: nn.Parameter, new: nn.Parameter) -> nn.Parameter:
    """Carry tensor parallelism's marks (which slice, how its gradient reduces) over to a
    parameter that replaces `old` (a ZeRO alias, a low-precision compute copy): without them
    a partial gradient would never be summed over tp."""
    for attr in ("tp_slice", "tp_kind", "reduce_dim"):  # reduce_dim: parallel/expert.py
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    return new


@dataclass
class TensorParallel:
    """What the rest of the engine needs after the transformation: the loss, the gradient
    reductions the optimizer calls, and the gather of shards back to full shape."""

    comm: Comm
    sp: bool = False
    vocab: tuple[int, int] | None = None  # (first id, real ids) of this rank's head slice
    slices: dict[str, LocalSlice] = field(default_factory=dict)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy; vocabulary-parallel when the head is split."""
        if self.vocab is None:
            flat = logits.float().flatten(0, -2)
            return F.cross_entropy(flat, targets.flatten(), reduction="sum")
        return vocab_cross_entropy(logits, targets, *self.vocab, self.comm)

    def reduce_partial(self, grads: list[torch.Tensor]) -> None:
        """Sum the partial gradients of `partial` parameters over tp (one flat all-reduce)."""
        if not grads or self.comm.topo.size("tp") == 1:
            return
        flat = torch.cat([g.flatten() for g in grads])
        self.comm.all_reduce(flat, "tp")
        for g, v in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(v.view_as(g))

    def sum_over_shards(self, parts: torch.Tensor) -> None:
        """parts = [squared norm of tp-sharded gradients, of the rest]: the first adds up
        over tp, the second is the same on every tp rank (bookkeeping traffic)."""
        self.comm.all_reduce(parts[:1], "tp", control=True)

    @torch.no_grad()
    def full_parameters(
        self, params: dict[str, torch.Tensor], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Full-shape CPU values by name (collective over tp: every rank must call it);
        `device` is where the collectives run."""
        out = {}
        for name, value in params.items():
            cut = self.slices.get(name)
            if cut is None:
                out[name] = value
                continue
            full = cut.place(value.to(device))
            self.comm.all_reduce(full, "tp", control=True)  # zeros elsewhere: exact
            out[name] = full.narrow(cut.dim, 0, cut.full_shape[cut.dim]).cpu()
        return out


def _matches(path: str, pattern: str) -> bool:
    return path.count(".") == pattern.count(".") and fnmatch.fnmatchcase(path, pattern)


def _matmul(module: nn.Module, x: torch.Tensor, weight, bias) -> torch.Tensor:
    if is_conv1d(module):
        y = torch.matmul(x, weight)
        return y if bias is None else y + bias
    if is_fp8(module):  # precision.fp8: this rank's slice through the layer's FP8 casts
        return fp8_matmul(module, x, weight, bias)
    return F.linear(x, weight, bias)


class _Sharder:
    """Applies one plan to one model for one tp rank."""

    def __init__(self, model: nn.Module, comm: Comm, sp: bool) -> None:
        self.model, self.comm, self.sp = model, comm, sp
        self.t, self.r = comm.topo.size("tp"), comm.topo.coord("tp")
        self.new: dict[int, nn.Parameter] = {}  # old parameter id -> local parameter
        self.state = TensorParallel(comm, sp)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return enter_tp(x, self.comm, self.sp)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        return exit_tp(x, self.comm, self.sp)

    def shard(self, path: str, module: nn.Module, leaf: str, dim: int, ranges, padded=0):
        """Give `module.leaf` the local shape of `ranges` along `dim` (a tied weight once)."""
        p = module._parameters[leaf]
        if p is None:
            return
        cut = LocalSlice(tuple(p.shape), dim, tuple(ranges), padded or p.shape[dim])
        if id(p) in self.new:
            if self.new[id(p)].tp_slice != cut:
                raise ValueError(f"{path}.{leaf}: a tied weight is split two different ways")
            return
        shape = list(p.shape)
        shape[dim] = sum(b - a for a, b in ranges)
        local = nn.Parameter(p.new_empty(shape), requires_grad=p.requires_grad)
        local.tp_slice, local.tp_kind = cut, "shard"
        self.new[id(p)] = local

    def even(self, path: str, module: nn.Module, what: str, size: int) -> tuple[int, int]:
        if size % self.t:
            raise ConfigError(
                f"{path}: {what} {size} is not divisible by parallel.tp={self.t}. Fix: choose "
                f"tp dividing {size}, or change the model size."
            )
        n = size // self.t
        return self.r * n, (self.r + 1) * n

    # -- the kinds -----------------------------------------------------------------------------
    def column(self, path: str, m: nn.Module, own_entry: bool) -> None:
        d = out_dim(m)
        lo, hi = self.even(path, m, "output width", m.weight.shape[d])
        self.shard(path, m, "weight", d, [(lo, hi)])
        self.shard(path, m, "bias", 0, [(lo, hi)])
        m.tp_out = hi - lo
        self._set_forward(m, own_entry, lambda x: _matmul(m, x, m.weight, m.bias))

    def column_qkv(self, path: str, m: nn.Module, own_entry: bool) -> None:
        d = out_dim(m)
        width = m.weight.shape[d] // 3
        lo, hi = self.even(path, m, "q/k/v width", width)
        ranges = [(k * width + lo, k * width + hi) for k in range(3)]
        self.shard(path, m, "weight", d, ranges)
        self.shard(path, m, "bias", 0, ranges)
        m.tp_out = 3 * (hi - lo)
        self._set_forward(m, own_entry, lambda x: _matmul(m, x, m.weight, m.bias))

    def column_kv(self, path: str, m: nn.Module, own_entry: bool, head_dim: int) -> None:
        d = out_dim(m)
        heads = m.weight.shape[d] // head_dim
        if heads % self.t == 0:
            return self.column(path, m, own_entry)
        if self.t % heads:
            raise ConfigError(
                f"{path}: {heads} kv heads and parallel.tp={self.t}: tp must divide the kv "
                "heads or be a multiple of them. Fix: change parallel.tp or model.n_kv_heads."
            )
        # t > kv: rank r's query heads all read kv head r·kv/t; keep the full (replicated)
        # weight, use its rows, and sum the partial gradients over tp (`partial`).
        j = self.r * heads // self.t
        for leaf in ("weight", "bias"):
            p = m._parameters.get(leaf)
            if p is not None:
                p.tp_kind = "partial"
        m.tp_out = head_dim

        def select(x, m=m, j=j):
            w = m.weight.narrow(d, j * head_dim, head_dim)
            b = None if m.bias is None else m.bias.narrow(0, j * head_dim, head_dim)
            return _matmul(m, x, w, b)

        self._set_forward(m, own_entry, select)

    def row(self, path: str, m: nn.Module) -> None:
        d = 1 - out_dim(m)
        lo, hi = self.even(path, m, "input width", m.weight.shape[d])
        self.shard(path, m, "weight", d, [(lo, hi)])

        def forward(x, m=m):
            y = self.exit(_matmul(m, x, m.weight, None))
            return y if m.bias is None else y + m.bias

        m.forward = forward

    def vocab(self, path: str, m: nn.Module, own_entry: bool) -> None:
        size = m.weight.shape[0]  # Embedding [V, h], Linear head [V, h]
        n = -(-size // self.t)  # padded to a multiple of t; padding never reaches the loss
        lo = self.r * n
        self.shard(path, m, "weight", 0, [(lo, lo + n)], padded=n * self.t)
        valid = max(0, min(n, size - lo))
        if isinstance(m, nn.Embedding):

            def lookup(ids, m=m):
                local = ids - lo
                outside = (local < 0) | (local >= n)
                y = F.embedding(local.masked_fill(outside, 0), m.weight)
                return self.exit(y.masked_fill(outside[..., None], 0.0))

            m.forward = lookup
            return
        if self.state.vocab is not None:
            raise ValueError(f"{path}: a second vocabulary-parallel head")
        self.state.vocab = (lo, valid)
        self._set_forward(m, True, lambda x, m=m: _matmul(m, x, m.weight, m.bias))

    def positions(self, m: nn.Module) -> None:
        if not self.sp:
            return

        def lookup(positions, m=m):  # the local chunk holds positions r·s/t ...
            return F.embedding(positions + self.r * positions.numel(), m.weight)

        m.forward = lookup

    def _set_forward(self, m: nn.Module, own_entry: bool, compute: Callable) -> None:
        m.forward = (lambda x: compute(self.enter(x))) if own_entry else compute

    def enter_at(self, parent: nn.Module) -> None:
        """One region entry for all column children of `parent`: its first input (or the
        `hidden_states` keyword of a Hugging Face module) goes through f once."""

        def hook(module, args, kwargs):
            if args:
                return (self.enter(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": self.enter(kwargs["hidden_states"])}

        parent.register_forward_pre_hook(hook, with_kwargs=True)

    def finish(self) -> None:
        """Re-point every use of a split parameter (tied ones too) and mark the rest."""
        for module in self.model.modules():
            for leaf, p in list(module._parameters.items()):
                if p is not None and id(p) in self.new:
                    module._parameters[leaf] = self.new[id(p)]
        for name, p in self.model.named_parameters():
            if not hasattr(p, "tp_kind"):
                # with SP, replicated parameters see only this rank's sequence chunk
                p.tp_kind = "partial" if self.sp else "replica"
            if getattr(p, "tp_slice", None) is not None:
                self.state.slices[name] = p.tp_slice


def apply_tensor_parallel(
    model: nn.Module, comm: Comm, plan: TPPlan | None, sp: bool = False
) -> TensorParallel:
    """Split `model` (on the meta device) over the tp dimension of `comm` following `plan`;
    with `sp`, also shard the rest along the sequence. A no-op at tp = 1."""
    t = comm.topo.size("tp")
    if t == 1:
        return TensorParallel(comm)
    if sp and not plan.sequence_parallel:
        raise ConfigError(
            f"parallel.sp=true is not available for {type(model).__name__}: its forward "
            "derives positions and masks from the local sequence length. Fix: --parallel.sp=false."
        )
    s = _Sharder(model, comm, sp)
    modules = dict(model.named_modules())
    kinds = {}
    for path in modules:
        hits = [k for pat, k in plan.rules.items() if _matches(path, pat)]
        if hits:
            kinds[path] = hits[0]
    if not any(k != "positions" for k in kinds.values()):
        raise ValueError(f"the tensor-parallel plan matches no module of {type(model).__name__}")
    parents: dict[str, int] = {}
    for path, kind in kinds.items():
        if kind in COLUMNS:
            parents[path.rpartition(".")[0]] = parents.get(path.rpartition(".")[0], 0) + 1
    shared = {p for p, n in parents.items() if n >= 2}
    for path, kind in kinds.items():
        m, parent = modules[path], path.rpartition(".")[0]
        own = parent not in shared
        if is_lora_layer(m):  # an adapter splits with the layer it adapts
            split_lora(s, path, m, kind, own)
        elif kind == "column":
            s.column(path, m, own)
        elif kind == "column:kv":
            s.column_kv(path, m, own, modules[parent].head_dim)
        elif kind == "column:qkv":
            s.column_qkv(path, m, own)
        elif kind == "row":
            s.row(path, m)
        elif kind == "vocab":
            s.vocab(path, m, own)
        elif kind == "positions":
            s.positions(m)
        elif kind == "partial":  # whole here, used on this rank's heads only
            for p in m.parameters():
                p.tp_kind = "partial"
        elif kind != "replicate":
            raise ValueError(f"unknown tensor-parallel kind {kind!r} for {path}")
    for parent in sorted(shared):
        s.enter_at(modules[parent])
    for m in modules.values():  # dropout draws whole per-sample masks and keeps its slice
        # (a LoRA adapter's "features" dropout is cut by its row-parallel layer only)
        if isinstance(m, LayoutFreeDropout) and (
            m.split == "heads" or (sp and m.split != "features")
        ):
            m.shard = (s.r, t)
    s.finish()
    _fix_counts(model, plan, t, modules)
    if sp:
        _whole_positions(model)
    return s.state


def _whole_positions(model: nn.Module) -> None:
    """A transformers model numbers its positions (RoPE) from its embedding's output, which
    sequence parallelism leaves at s/t tokens, while its attention sees all s (gathered): hand
    its forward the whole sequence's positions. Its causal mask stays SDPA's is_causal (none
    is built for an unpadded batch), taken over the gathered sequence; a sliding window
    shorter than the sequence gets its mask over all s tokens (its forward would build it over
    s/t, models/hf/window.py)."""
    if not hasattr(model, "set_attn_implementation"):  # not a transformers model
        return
    from shardwise.models.hf.window import whole_sequence_masks

    def hook(_model, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device)[None]
        mask = whole_sequence_masks(model.config, ids.shape[1], ids.device)
        if mask is not None:
            kwargs["attention_mask"] = mask
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _fix_counts(model: nn.Module, plan: TPPlan, t: int, modules: dict) -> None:
    """Foreign attention modules keep head counts and widths as attributes: shrink them."""
    for path, module in modules.items():
        for pattern, attrs in plan.divide.items():
            if _matches(path, pattern):
                for attr in attrs:
                    setattr(module, attr, getattr(module, attr) // t)
        q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if hasattr(module, "num_key_value_groups") and hasattr(q, "tp_out"):
            module.num_key_value_groups = q.tp_out // k.tp_out
