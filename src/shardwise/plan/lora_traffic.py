"""What LoRA (finetune/lora.py) changes in the tensor-parallel traffic of plan/traffic.py: with
every base parameter frozen, a region's backward collective runs only where its input needs a
gradient, and only the adapters' gradients are summed over tp."""

from __future__ import annotations

from collections import Counter

from shardwise.models.moe import is_moe_block
from shardwise.plan import moe
from shardwise.plan.adapters import linear_fans
from shardwise.plan.layout import Job, Layout
from shardwise.plan.shapes import block_entries, dense_spec, moe_block_entries

_ATTENTION = frozenset(("wq", "wk", "wv", "wqkv", "wo"))
_MLP = frozenset(("w1", "w3", "w2"))
# models/tp_plans: the output projections are row-parallel (their input split), the rest column
_ROW_PARALLEL = ("wo", "w2")


def unrun_backward(job: Job, layout: Layout) -> Counter[str]:
    """The tp collectives per micro-batch (each of one micro-batch's activation) whose backward
    never runs in a LoRA run, by kind. parallel/tensor_comm's region operators are autograd
    Functions: one whose input needs no gradient has no backward. The frozen embedding's output
    needs none, nor does anything after it up to the first adapted linear: the embedding's exit
    (sp: its all-gather), the first block's attention entry and, with nothing adapted in that
    attention, its exit (sp) and the MLP's entry too (an MoE layer under sp has neither:
    plan/traffic._moe_tp_kinds). tp needs targets that every block has (plan/valid.py), so the
    first block's MLP is adapted when its attention is not."""
    ft, out = job.finetune, Counter()
    if not ft.lora or job.spec is None:
        return out
    entry = "reduce_scatter" if layout.sp else "all_reduce"  # an exit's: sp only
    out[entry] += 1  # the first block's attention entry
    if layout.sp:
        out["all_gather"] += 1  # the embedding's exit
    if not set(ft.lora_targets) & _ATTENTION:  # nothing adapted in the attention
        out["all_gather"] += layout.sp  # the attention's exit
        out[entry] += not is_moe_block(job.spec, 0)  # the MLP's entry
    return +out  # (no zero counts: a kind the layout does not send)


def lora_partial(job: Job, blocks: tuple[int, ...] | None = None) -> int:
    """Elements of the adapters whose gradients are summed over tp (parallel/tensor_lora): A of
    a column-parallel target, B of a row-parallel one, both of an MoE layer's router's (whole
    on every tp rank, each seeing its sequence shard under sp, which tp requires with experts;
    adapters on experts or shared experts refuse tp). The frozen rest has no gradient. Of the
    blocks with indices `blocks` (a pipeline stage's), all by default."""
    spec = job.spec
    dense = block_entries(dense_spec(spec))
    attention = [e for e in dense if not _is_mlp(e)]  # (and the norms)
    if blocks is None:
        blocks = tuple(range(spec.n_layers))
    moe_layers = sum(is_moe_block(spec, i) for i in blocks)
    out = (len(blocks) - moe_layers) * _partial_elements(job, dense, [])
    if moe_layers:  # (shapes.moe_block_entries: the dense block's attention and norms first)
        whole = moe_block_entries(spec, 1, dense)[len(attention) :]
        out += moe_layers * _partial_elements(job, attention, whole)
    return out


def _is_mlp(entry: tuple) -> bool:
    """Whether a block entry (shapes.block_entries) is an MLP linear's weight."""
    return len(entry) > 2 and entry[2] in _MLP


def _partial_elements(job: Job, split: list, whole: list) -> int:
    """One block's partial adapter elements: of the adapted linears among the tp-split
    entries `split` A or B by the split, of those among the `whole` entries both."""
    spec, ft = job.spec, job.finetune
    shapes, out = moe.lora_shapes(spec), 0
    for e, both in [(e, False) for e in split] + [(e, True) for e in whole]:
        tag = e[2] if len(e) > 2 else None
        if isinstance(tag, str) and tag in ft.lora_targets:  # (an expert's tag is its shape)
            fan_in, fan_out = linear_fans(spec, shapes, tag, e[0])
            out += ft.lora_rank * (fan_in + fan_out if both else _split_side(tag, fan_in, fan_out))
    return out


def _split_side(tag: str, fan_in: int, fan_out: int) -> int:
    """The width of the adapter matrix whole on every tp rank of a split linear `tag`."""
    return fan_out if tag in _ROW_PARALLEL else fan_in
