"""Expert parallelism: the routed experts of every MoE layer sharded over the `ep` ranks of a
dp line, tokens exchanged by all-to-all (GShard, Lepikhin et al. 2020; Megatron-Core's expert
parallelism), as a transformation of the plain MoE decoder on the meta device.

* Each rank keeps E/ep contiguous experts of each layer: the stacked weights w1, w3, w2 become
  [E/ep, ...] slices that remember where they come from (`tp_slice`, models/init.LocalSlice),
  so init draws the full (seed, name) value and keeps the slice, and checkpoints store the
  global names and shapes (an ep=4 checkpoint resumes at ep=1 and back).
* The layer's router, shared experts and the rest of the model stay replicated over dp.
* LoRA pairs on the stacked weights ([E, r, in] and [E, out, r], models/expert_lora.py) are
  cut the same way, with the weight they adapt, and reduced over the same ranks.
* Expert gradients are summed over the "edp" ranks holding the same experts (dp / ep of them)
  and ZeRO shards them there (`reduce_dim`); every token's contribution is in them already,
  because the all-to-all brought every ep rank's rows to the experts (parallel/expert_comm.py).
* In the global norm the expert slices add up over ep (`tp_kind = "shard"`: with tp = 1, the
  only layout ep runs in, that kind is summed over the dp line under ZeRO and over ep here).

Why the numbers do not change: routing, capacity (per sequence) and the balance statistics
are computed where the tokens are, as on one process; the experts compute the same rows; the
loss is divided by the global token count, so the sums over ranks are the single run's."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.config import Config
from shardwise.distributed.comm import Comm
from shardwise.errors import ConfigError
from shardwise.models.expert_lora import PARTS, ExpertAdapters, expert_adapters
from shardwise.models.families.base import Family
from shardwise.models.hf.experts import experts_modules, routers, stacked_weights
from shardwise.models.init import LocalSlice, canonical_name
from shardwise.models.moe import MoE, moe_layers
from shardwise.models.presets import ModelSpec
from shardwise.parallel.expert_comm import ExpertExchange, SequenceShards

EXPERT_WEIGHTS = ("w1", "w3", "w2")


class ExpertParallel:
    """What the engine needs after the transformation: the expert slices by parameter name,
    the gather back to full shape and the norm's reduction over ep."""

    def __init__(self, comm: Comm, slices: dict[str, LocalSlice]) -> None:
        self.comm, self.slices = comm, slices

    def sum_over_shards(self, parts: torch.Tensor) -> None:
        """parts = [squared norm of sharded gradients, of the rest] on a replicated (ZeRO-0)
        rank: the expert slices differ over ep and add up (bookkeeping traffic)."""
        self.comm.all_reduce(parts[:1], "ep", control=True)

    def mark_norm_targets(self, targets: list) -> list:
        """ZeRO-0 with tp > 1: the sharded part of the norm is summed over ep and tp, so the
        expert slices (equal over tp once reduced) count on tp rank 0 only, and the dense
        tp shards (equal over ep) on ep rank 0 only: each tensor once."""
        topo = self.comm.topo
        if topo.size("tp") == 1:
            return targets
        for t in targets:
            expert = getattr(t.param, "reduce_dim", "dp") == "edp"
            if (expert and topo.coord("tp")) or (
                t.tp == "shard" and not expert and topo.coord("ep")
            ):
                t.in_norm = False
        return targets

    @torch.no_grad()
    def full_parameters(
        self, params: dict[str, torch.Tensor], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Full-shape CPU values by name (collective over ep: every rank must call it)."""
        out = dict(params)
        for name, value in params.items():  # (names may carry wrapper segments)
            cut = self.slices.get(canonical_name(name))
            if cut is not None:
                full = cut.place(value.to(device))
                self.comm.all_reduce(full, "ep", control=True)  # zeros elsewhere: exact
                out[name] = full.cpu()
        return out


def apply_expert_parallel(model: nn.Module, comm: Comm) -> ExpertParallel | None:
    """Give every MoE layer of the meta `model` this rank's experts and the exchange; a no-op
    at ep = 1. Names stay, so init, ZeRO units and checkpoints see ordinary tensors."""
    ep = comm.topo.size("ep")
    if ep == 1:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    slices: dict[str, LocalSlice] = {}
    for layer, e, leaves in _expert_layers(model):
        if e % ep:  # (validated earlier; a model built another way would fail here)
            raise ConfigError(
                f"parallel.ep={ep} must divide the {e} experts of each MoE layer. Fix: an ep "
                "dividing it."
            )
        exchange = ExpertExchange(comm, e)
        lo, hi = exchange.first, exchange.first + exchange.local
        path = names[id(layer)]
        for leaf in leaves:
            slices[f"{path}.{leaf}"] = _keep_experts(layer, leaf, lo, hi)
        for leaf in expert_adapters(layer):  # LoRA pairs split with the weight they adapt
            for part in PARTS:
                slices[f"{path}.{part}.{leaf}"] = _keep_experts(getattr(layer, part), leaf, lo, hi)
        layer.exchange = exchange
    return ExpertParallel(comm, slices)


def _keep_experts(owner: nn.Module, leaf: str, lo: int, hi: int) -> LocalSlice:
    """Replace the meta [E, ...] parameter `owner.leaf` by its experts [lo, hi), marked as a
    slice reduced over the ranks holding the same experts; returns the slice."""
    p = owner._parameters[leaf]
    if not p.is_meta:
        raise ValueError("expert parallelism transforms a model on the meta device")
    cut = LocalSlice(tuple(p.shape), 0, ((lo, hi),), p.shape[0])
    local = nn.Parameter(
        torch.empty((hi - lo, *p.shape[1:]), dtype=p.dtype, device="meta"),
        requires_grad=p.requires_grad,
    )
    local.tp_slice, local.tp_kind, local.reduce_dim = cut, "shard", "edp"
    owner._parameters[leaf] = local
    return cut


def apply_sequence_shards(model: nn.Module, comm: Comm, sp: bool) -> None:
    """Tensor parallelism leaves the MoE layers whole (no rule of models/tp_plans.py matches
    them: Megatron-Core's expert tensor parallel size 1); with sequence parallelism each tp
    rank routes its own shard of every sequence through them, and the layers learn the other
    shards' counts (capacity and balance loss per whole sequence). Their parameters' partial
    gradients are summed over tp (parallel/tensor.py marks them `partial`; with ep > 1 the
    expert slices are reduced over the "edp" group, which holds the tp ranks)."""
    if comm.topo.size("tp") == 1 or not sp:  # (validate refuses MoE tp without sp)
        return
    shards = SequenceShards(comm)
    for layer in moe_layers(model):
        layer.shards = shards
    for router in routers(model):  # a transformers class's: its loads are summed over tp
        router.shards = shards


def _expert_layers(model: nn.Module) -> list[tuple[nn.Module, int, tuple[str, ...]]]:
    """(module, experts, stacked weight names) of every MoE layer: ours (models/moe.py) or a
    transformers class's stacked experts (models/hf/experts.py)."""
    ours = [(m, m.n_experts, EXPERT_WEIGHTS) for m in moe_layers(model)]
    theirs = [(m, int(m.num_experts), stacked_weights(m)) for m in experts_modules(model)]
    return ours + theirs


def expert_parallel_of(model: nn.Module, comm: Comm) -> ExpertParallel | None:
    """The transformation's record for a model it was applied to (after ZeRO or a cast
    replaced the parameters, which keep their marks); None at ep = 1."""
    if comm.topo.size("ep") == 1:
        return None
    slices = {
        canonical_name(name): p.tp_slice
        for name, p in model.named_parameters()
        if getattr(p, "reduce_dim", "dp") == "edp"
    }
    return ExpertParallel(comm, slices)


def check_expert_parallel(cfg: Config, spec: ModelSpec, family: Family, shared: int) -> None:
    """parallel.ep: what expert parallelism runs with in this first step; `shared` counts the
    ranks sharing the dense parameters (world / (tp * pp))."""
    p, ep = cfg.parallel, cfg.parallel.ep
    if ep < 1:
        raise ConfigError(f"parallel.ep={ep} must be >= 1. Fix: --parallel.ep=1 (off).")
    if ep == 1:
        return
    fix = " Fix: --parallel.ep=1."
    why, (experts, key) = "", routed_experts(spec, family)
    if not family.expert_parallel or not experts:
        why = (
            f"model.name='{cfg.model.name}' is {family.kind} without routed experts; expert "
            "parallelism shards the experts of the built-in MoE decoder (moe-tiny, moe-1b) "
            "and of Hugging Face MoE checkpoints (Mixtral, Qwen2/3-MoE, OLMoE)"
        )
    elif experts % ep:
        why = f"it must divide {key}={experts} (each rank holds E / ep)"
        fix = f" Fix: an ep dividing {key}, or --parallel.ep=1."
    elif shared % ep:
        why = f"it must divide the {shared} ranks sharing the dense parameters (world / (tp * pp))"
        fix = f" Fix: an ep dividing {shared}, or another world size."
    elif p.grad_compression != "none":
        why = (
            f"parallel.grad_compression={p.grad_compression} is not built for the expert "
            "gradients' own reduction group"
        )
        fix = " Fix: --parallel.grad_compression=none, or --parallel.ep=1."
    if why:
        raise ConfigError(f"parallel.ep={ep}: {why}.{fix}")


def is_expert_weight(module: nn.Module, leaf: str) -> bool:
    """Whether `module.leaf` is a routed expert weight that expert parallelism shards."""
    if isinstance(module, ExpertAdapters):  # a LoRA pair of a stacked weight: cut with it
        return True
    if isinstance(module, MoE):
        return leaf in EXPERT_WEIGHTS
    return module in experts_modules(module) and leaf in stacked_weights(module)


def holds_routed_experts(module: nn.Module) -> bool:
    """Whether any weight under `module` is a routed expert weight (`is_expert_weight`)."""
    return any(
        is_expert_weight(m, leaf)
        for m in module.modules()
        for leaf, _ in m.named_parameters(recurse=False)
    )


def routed_experts(spec, family) -> tuple[int, str]:
    """How many routed experts a layer of the model has, and the key that says so: the
    built-in MoE decoder's `model.n_experts`, or a transformers MoE checkpoint's config."""
    if family.expert_parallel and family.from_checkpoint:  # the checkpoint's config says
        return checkpoint_experts(spec.source)
    return spec.n_experts, "model.n_experts"


def checkpoint_experts(source: str) -> tuple[int, str]:
    """(routed experts per layer, the config key naming them) of a Hugging Face checkpoint;
    (0, "") for one without experts."""
    from shardwise.models.hf.auto import read_hf_config

    config = read_hf_config(source)
    for key in ("num_local_experts", "num_experts"):  # Mixtral; Qwen2/3-MoE, OLMoE
        if getattr(config, key, 0):
            return int(getattr(config, key)), f"the checkpoint's {key}"
    return 0, ""
