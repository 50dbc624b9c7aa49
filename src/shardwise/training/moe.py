"""MoE load balancing in the loop: the balance loss's gradient, the step's expert statistics
reduced over the global batch, and the auxiliary-loss-free bias update (models/moe.py).

Layout invariance: the balance loss is a sum over sequences divided by the global token count,
like the LM loss; loads and drops are counts summed over every rank's micro-batches, so the
bias moves identically on every rank and in every layout (DeepSeek-V3 2024, §2.1.2)."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.config import TrainConfig
from shardwise.distributed.comm import Comm
from shardwise.models.hf.experts import router_stats
from shardwise.models.moe import MoEDecoder, moe_layer_count, moe_layers


class _AuxGrad(torch.autograd.Function):
    """Identity on a pipeline chunk's output that also starts the backward of the chunk's
    balance loss with `weight` (Megatron-Core's MoEAuxLossAutoScaler): a stage without the LM
    loss has no loss to add it to, and its backward starts at this output."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux = weight, (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        shape, dtype, device = ctx.aux
        return g, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


class ExpertTally:
    """One step's statistics of every MoE layer on this rank: per-expert chosen counts [E],
    dropped assignments, the sum of per-sequence balance losses, sequences. One row per MoE
    layer of the whole model (`MoE.index`): a pipeline stage fills its own layers' rows (a
    stage may hold none) and `after_step` sums the others' in over the `stages`."""

    def __init__(self, model: nn.Module, train: TrainConfig, stages: int = 1) -> None:
        # shardwise's MoE layers, or a transformers MoE model's routers (loads only: dropless,
        # no balance loss or bias of ours; models/hf/experts.py)
        self.layers = moe_layers(model) or router_stats(model)
        self.balance = all(getattr(layer, "balance", True) for layer in self.layers)
        self.coef, self.rate, self.stages = train.moe_aux_loss, train.moe_bias_balance, stages
        # rows in the whole model's order where the layers know it (ours); else this rank's
        self.global_rows = all(hasattr(layer, "index") for layer in self.layers)
        self.rows = [getattr(layer, "index", i) for i, layer in enumerate(self.layers)]
        n_rows, width = len(self.layers), self.layers[0].n_experts + 3 if self.layers else 0
        if isinstance(model, MoEDecoder):  # (a pipeline stage's part of one)
            n_rows, width = moe_layer_count(model.spec), model.spec.n_experts + 3
        elif hasattr(model, "moe_table"):  # a stage of a transformers MoE model (pipeline_hf)
            n_rows, width = model.moe_table
            self.balance = False  # its routers' loads only, also on a stage holding none
        self.sums = torch.zeros(n_rows, width, dtype=torch.float64)

    def _take(self, scope: list[nn.Module] | None) -> list[torch.Tensor]:
        """Tally the forward of the layers inside the modules `scope` (None: all of them);
        returns their balance terms (the graphs are the caller's now)."""
        inside = None if scope is None else {id(m) for s in scope for m in s.modules()}
        # a transformers router's statistics are found by the router they read
        mine = [
            i
            for i, layer in enumerate(self.layers)
            if inside is None or id(getattr(layer, "router", layer)) in inside
        ]
        if not mine:
            return []
        last = torch.stack([self.layers[i].last for i in mine])
        self.sums = self.sums.to(last.device)
        rows = torch.tensor([self.rows[i] for i in mine], device=last.device)
        self.sums.index_add_(0, rows, last.to(self.sums.dtype))
        aux = [self.layers[i].aux for i in mine if self.layers[i].aux is not None]
        for i in mine:
            self.layers[i].aux = None
        return aux

    def after_forward(
        self, loss: torch.Tensor, global_count: int, scope: list[nn.Module] | None = None
    ) -> torch.Tensor:
        """Tally a training micro-batch's forward (of the layers in `scope`: a pipeline's last
        chunk); `loss` (already divided by the global count) gains the balance loss's gradient,
        and keeps its value: the logged loss stays the LM loss, the balance loss is logged
        apart (moe_aux_loss)."""
        aux = self._take(scope)
        if not self.coef or not aux:
            return loss
        extra = self.coef * torch.stack(aux).sum() / global_count
        return loss + (extra - extra.detach()).to(loss.dtype)  # + 0, with extra's gradient

    def after_chunk(
        self, out: torch.Tensor, global_count: int, scale: float, scope: list[nn.Module]
    ) -> torch.Tensor:
        """A pipeline chunk without the loss: tally its layers' forward and return `out`,
        whose backward also runs their balance loss's, scaled like the loss (`scale`)."""
        aux = self._take(scope)
        if not self.coef or not aux:
            return out
        return _AuxGrad.apply(out, torch.stack(aux).sum(), self.coef / global_count * scale)

    @torch.no_grad()
    def after_step(self, comm: Comm, skipped: bool) -> dict[str, object]:
        """Sum the step's statistics over dp, pipeline stages and sequence shards (through the
        comm layer: bookkeeping-sized, counted with the loss's), move the biases unless the
        step was skipped, and return the metrics: per layer max/mean expert load and dropped
        tokens, and the mean balance loss."""
        for layer in self.layers:  # a recomputed forward in backward set it again: its graph
            layer.aux = None  # (router input, scores) would live through the step and eval
        sums = self.sums
        comm.all_reduce(sums, "dp", control=True)
        if self.global_rows and self.stages > 1:  # every stage's layers, every row
            comm.all_reduce(sums, "pp", control=True)
        if any(getattr(layer, "shards", None) is not None for layer in self.layers):
            comm.all_reduce(sums, "tp", control=True)  # each tp rank tallied its sequence shard
        load, dropped, aux, seqs = sums[:, :-3], sums[:, -3], sums[:, -2], sums[:, -1]
        mean = load.mean(-1, keepdim=True)
        if self.rate and not skipped:
            for layer, row in zip(self.layers, self.rows, strict=True):
                step = self.rate * torch.sign(mean[row] - load[row])
                layer.expert_bias += step.to(layer.expert_bias)
        # one read to the host for every layer's statistics (a host sync each, read apart)
        ratio, n = load.max(-1).values / mean[:, 0], sums.shape[0]
        values = torch.cat([ratio, dropped, (aux / seqs).mean().reshape(1)]).tolist()
        out: dict[str, object] = {"moe_load_max_mean": [round(v, 6) for v in values[:n]]}
        if self.balance:
            out.update(moe_dropped=[int(v) for v in values[n : 2 * n]], moe_aux_loss=values[-1])
        self.sums = torch.zeros_like(sums)
        return out


def expert_tally(model: nn.Module, train: TrainConfig, stages: int = 1) -> ExpertTally | None:
    """The tally of `model`'s MoE layers (or a transformers MoE model's routers), also on a
    pipeline stage of an MoE decoder that holds none of them (it joins the sum over the
    `stages`); None for a model without any."""
    tally = ExpertTally(model, train, stages)
    return tally if tally.layers or tally.sums.shape[0] else None
