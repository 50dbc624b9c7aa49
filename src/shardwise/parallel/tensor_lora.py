"""Tensor parallelism for a layer peft wrapped with a LoRA adapter (finetune/lora.py).

The adapter is split with the layer it adapts, so the sum base(x) + B(A(x))·s stays one
layer's output (Hu et al. 2021 on a Megatron split):

* column-parallel base (output features split): B's rows are split like the base's; A is
  whole on every tp rank and sees the same (entered) input, but each rank's gradient of A
  comes from its own rows of B only, so A is `partial` (summed over tp once per step);
* row-parallel base (input features split): A's columns are split like the base's input,
  B is whole; base and adapter outputs are both partial sums, added before the one exit
  reduction (the bias after it), so B's gradient is `partial` too. The adapter's dropout
  then sees a feature-cut input and keeps its columns of the whole mask.

An adapter on a vocabulary-parallel layer, or on a k/v projection whose heads are fewer than
the tp ranks (replicated, narrowed per rank), is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.finetune.lora import ADAPTER
from shardwise.finetune.quant import QuantLinear
from shardwise.models.tp_plans import out_dim


def _partial(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The row-parallel base's local product, without the bias (added after the sum)."""
    return torch.matmul(x, base.weight) if out_dim(base) else F.linear(x, base.weight)


def split_lora(s, path: str, w: nn.Module, kind: str, own_entry: bool) -> None:
    """Split the LoRA layer `w` at `path` whose base the plan marks `kind`; `s` is
    parallel/tensor.py's sharder for this rank. A quantised base (finetune/quant) keeps its
    storage split over the ranks and multiplies by its rows (column) or columns (row) of the
    dequantised weight; the adapter splits alike over either base."""
    base, a, b = w.base_layer, w.lora_A[ADAPTER], w.lora_B[ADAPTER]
    peft_forward = type(w).forward
    quantised = isinstance(base, QuantLinear)
    if kind == "column:kv":
        width = base.out_features if quantised else base.weight.shape[out_dim(base)]
        heads = width // s.model.get_submodule(path.rpartition(".")[0]).head_dim
        if heads % s.t:
            raise ConfigError(
                f"{path}: a LoRA adapter on a k/v projection with {heads} kv heads and "
                f"parallel.tp={s.t} (each rank keeps a replicated head). Fix: leave it out of "
                "finetune.lora_targets, or a tp dividing the kv heads."
            )
        kind = "column"
    if kind in ("column", "column:qkv"):
        ranges = _split_column_base(s, f"{path}.base_layer", base, kind)
        s.shard(f"{path}.lora_B.{ADAPTER}", b, "weight", 0, ranges)
        a.weight.tp_kind = "partial"
        w.tp_out = base.tp_out
        if own_entry:
            w.forward = lambda x: peft_forward(w, s.enter(x))
        else:
            w.forward = lambda x: peft_forward(w, x)
        return
    if kind != "row":
        raise ConfigError(
            f"{path}: a LoRA adapter on a {kind} layer cannot be split over parallel.tp={s.t}. "
            "Fix: leave it out of finetune.lora_targets, or --parallel.tp=1."
        )
    if quantised:
        lo, hi = s.even(path, base, "input width", base.in_features)
        base.take = (1, lo, hi)
        base.forward = base.product  # the bias after the reduction
    else:
        d = 1 - out_dim(base)
        lo, hi = s.even(path, base, "input width", base.weight.shape[d])
        s.shard(f"{path}.base_layer", base, "weight", d, [(lo, hi)])
        base.forward = lambda x: _partial(base, x)
    s.shard(f"{path}.lora_A.{ADAPTER}", a, "weight", 1, [(lo, hi)])
    b.weight.tp_kind = "partial"
    dropout = w.lora_dropout[ADAPTER]
    if hasattr(dropout, "shard"):  # LayoutFreeDropout: the input's columns are this rank's
        dropout.shard = (s.r, s.t)

    def forward(x):
        y = s.exit(peft_forward(w, x))
        return y if base.bias is None else y + base.bias

    w.forward = forward


def _split_column_base(s, path: str, base: nn.Module, kind: str) -> list[tuple[int, int]]:
    """Split a column-parallel base (its output rows); the ranges of them this rank keeps."""
    if not isinstance(base, QuantLinear):
        split = s.column if kind == "column" else s.column_qkv
        split(path, base, False)  # the entry is the LoRA wrapper's
        return list(s.new[id(base._parameters["weight"])].tp_slice.ranges)
    if kind != "column":
        raise ConfigError(
            f"{path}: a quantised base (finetune.base_quant) on a fused {kind} projection "
            f"cannot be split over parallel.tp={s.t}. Fix: leave it out of "
            "finetune.lora_targets, or --parallel.tp=1."
        )
    lo, hi = s.even(path, base, "output width", base.out_features)
    base.take, base.tp_out = (0, lo, hi), hi - lo
    if base.bias is not None:
        s.shard(path, base, "bias", 0, [(lo, hi)])
    return [(lo, hi)]
