"""transformers' stacked experts (Mixtral, Qwen2/3-MoE, OLMoE: `@use_experts_implementation`
classes) computed by shardwise's expert matmul (models/moe.py `expert_matmul`).

Why not transformers' own `grouped_mm` path: it calls `torch._grouped_mm` whenever the
function exists on CPU, and on fake tensors (the planner's measured forward) that kernel takes
bf16 only, so an fp32 run stopped before launch; on CUDA below Hopper torch's kernel is not
built for every dtype either. `expert_matmul` probes the kernel once per device type and dtype
and otherwise loops over experts, one matmul each, and splits evenly on fake tensors.
The routing, gating and weighting are transformers' (same sort, same order of the sum), so
the logits equal `from_pretrained`'s (tests/test_hf_moe.py).

Router loads for the metrics (`moe_load_max_mean`) are read by `RouterStat` from the
routers' outputs, the top-k expert indices each token chose."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.expert_lora import adapter_delta
from shardwise.models.moe import expert_matmul

NAME = "shardwise"


def _experts_forward(
    self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' grouped experts forward (integrations/moe.py) with `expert_matmul` for the
    two grouped products: tokens sorted by expert, [gate; up] product, gate, down product,
    routing weights, original order, sum over the top k."""
    k, n, e = top_k_index.size(-1), hidden.size(0), self.num_experts
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    xs = hidden[perm // k]
    # histc, not bincount: a fixed-size output, so fake tensors (no values) run it too
    counts = torch.histc(expert_ids.float(), bins=e, min=0, max=e - 1).long()
    exchange = getattr(self, "exchange", None)  # expert parallelism (parallel/expert.py)
    if exchange is None:
        out = _products(self, xs, counts)
    else:  # the rows go to the ranks holding their experts and come back in this order
        out = exchange(xs, counts, lambda rows, local: _products(self, rows, local))
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[inv].view(n, k, -1).sum(1).to(hidden.dtype)


def _products(self: nn.Module, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The experts held here on rows grouped by expert (counts [held experts]): the [gate;
    up] product, the gate, the down product."""
    up = "gate_up_proj" if self.has_gate else "up_proj"
    out = _product(self, up, xs, counts)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    return _product(self, "down_proj", out, counts)


def _product(self: nn.Module, leaf: str, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The rows times their expert's [E, out, in] weight `leaf`, plus its LoRA adapter's delta
    if it has one (models/expert_lora.py)."""
    out = expert_matmul(xs, getattr(self, leaf).transpose(-2, -1), counts)
    delta = adapter_delta(self, leaf, xs, counts, expert_matmul)
    return out if delta is None else out + delta


def stacked_weights(module: nn.Module) -> tuple[str, ...]:
    """The [E, out, in] parameter names of a stacked-experts module."""
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


def _plain(module: nn.Module) -> bool:
    """An experts module of the layout `_experts_forward` computes: [E, out, in] weights, no
    biases or post-expert norm, not split over ranks by transformers' expert parallelism."""
    return not (
        module.has_bias
        or module.has_post_expert_norm
        or module.is_transposed
        or module._is_expert_parallel
    )


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The model's stacked-experts modules (`@use_experts_implementation` classes)."""
    return [m for m in model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")]


def computes_experts(model: nn.Module) -> bool:
    """Whether `_experts_forward` computes `model`'s stacked experts: it has some, all of a
    layout it computes (else transformers' own forward runs them)."""
    found = experts_modules(model)
    return bool(found) and all(_plain(m) for m in found)


def use_shardwise_experts(model: nn.Module) -> None:
    """Make `model`'s stacked experts run through `_experts_forward` (a no-op for models without
    experts, or with a layout it does not compute: transformers' own forward then)."""
    if not computes_experts(model):
        return
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NAME, _experts_forward)
    model.set_experts_implementation(NAME)


def routers(model: nn.Module) -> list[nn.Module]:
    """The router of each MoE layer, in forward order: the class transformers records router
    logits from (`_can_record_outputs["router_logits"]`); [] for a model without one."""
    for module in model.modules():
        recorder = getattr(module, "_can_record_outputs", None) or {}
        target = getattr(recorder.get("router_logits"), "target_class", None)
        if target is not None:
            return [m for m in model.modules() if isinstance(m, target)]
    return []


def counted_routers(model: nn.Module) -> list[nn.Module]:
    """`routers(model)` when every one says its `num_experts` and `top_k` (its loads can be
    counted); else []."""
    found = routers(model)
    return found if all(hasattr(r, "num_experts") and hasattr(r, "top_k") for r in found) else []


def number_routers(model: nn.Module) -> None:
    """Before a pipeline stage prunes the whole model's layers: give each router its row in the
    whole model's table (`moe_row`, in forward order) and the model the table's shape
    (`moe_table`: rows, experts + 3), so that every stage, one holding no router too, tallies
    into rows the stages can sum (training/moe.py)."""
    found = counted_routers(model)
    if not found:
        return
    for row, router in enumerate(found):
        router.moe_row = row
    model.moe_table = (len(found), int(found[0].num_experts) + 3)


class RouterStat:
    """One router's statistics in the shape training/moe.py tallies for shardwise's own MoE
    layers: `last` [E + 3] (per-expert top-k choices of the latest forward, then dropped
    assignments, balance-loss sum and sequences, all 0: transformers' layers are dropless and
    shardwise adds no balance loss to them), `aux` None. A replayed forward (recomputation)
    overwrites `last` with the same counts, so it is read once per micro-batch forward."""

    balance = False  # no balance loss or bias: only the loads are reported

    def __init__(self, router: nn.Module) -> None:
        self.n_experts, self.top_k = int(router.num_experts), int(router.top_k)
        self.router = router  # a pipeline chunk tallies the routers inside it (training/moe.py)
        if hasattr(router, "moe_row"):  # a pipeline stage's: its row in the whole model's table
            self.index = router.moe_row
        self.last = torch.zeros(self.n_experts + 3)
        self.aux = None
        router.register_forward_hook(self._hook)

    @property
    def shards(self) -> object | None:
        """The router's `SequenceShards` under tp + sp (parallel/expert.py: it counts its rank's
        sequence shard only); None otherwise."""
        return getattr(self.router, "shards", None)

    def _hook(self, module: nn.Module, args, out) -> None:
        if not isinstance(out, tuple):
            return
        index = out[-1]
        if index.is_floating_point():  # no indices returned: the top k of the logits
            index = out[0].topk(self.top_k, dim=-1).indices
        if index.is_meta or _fake(index):  # the planner's forward: nothing to count
            return
        count = torch.bincount(index.reshape(-1), minlength=self.n_experts).float()
        self.last = torch.cat([count, count.new_zeros(3)])


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def router_stats(model: nn.Module) -> list[RouterStat]:
    """A `RouterStat` on each router of a transformers MoE model ([] for other models, or
    routers without `num_experts` and `top_k`)."""
    return [RouterStat(r) for r in counted_routers(model)]
