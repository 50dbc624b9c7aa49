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
from shardwise.models.moe import moe_layers


class ExpertTally:
    """One step's statistics of every MoE layer on this rank: per-expert chosen counts [E],
    dropped assignments, the sum of per-sequence balance losses, sequences."""

    def __init__(self, model: nn.Module, train: TrainConfig) -> None:
        # shardwise's MoE layers, or a transformers MoE model's routers (loads only: dropless,
        # no balance loss or bias of ours; models/hf/experts.py)
        self.layers = moe_layers(model) or router_stats(model)
        self.balance = all(getattr(layer, "balance", True) for layer in self.layers)
        self.coef, self.rate = train.moe_aux_loss, train.moe_bias_balance
        width = self.layers[0].n_experts + 3 if self.layers else 0
        self.sums = torch.zeros(len(self.layers), width, dtype=torch.float64)

    def after_forward(self, loss: torch.Tensor, global_count: int) -> torch.Tensor:
        """Tally a training micro-batch's forward; `loss` (already divided by the global count)
        gains the balance loss's gradient, and keeps its value: the logged loss stays the LM
        loss, the balance loss is logged apart (moe_aux_loss)."""
        self.sums = self.sums.to(loss.device)
        self.sums += torch.stack([layer.last for layer in self.layers])
        aux = [layer.aux for layer in self.layers if layer.aux is not None]
        for layer in self.layers:
            layer.aux = None  # the graph is the loss's now
        if not self.coef or not aux:
            return loss
        extra = self.coef * torch.stack(aux).sum() / global_count
        return loss + (extra - extra.detach()).to(loss.dtype)  # + 0, with extra's gradient

    @torch.no_grad()
    def after_step(self, comm: Comm, skipped: bool) -> dict[str, object]:
        """Sum the step's statistics over dp (through the comm layer: bookkeeping-sized, counted
        with the loss's), move the biases unless the step was skipped, and return the metrics:
        per layer max/mean expert load and dropped tokens, and the mean balance loss."""
        for layer in self.layers:  # a recomputed forward in backward set it again: its graph
            layer.aux = None  # (router input, scores) would live through the step and eval
        sums = self.sums
        comm.all_reduce(sums, "dp", control=True)
        load, dropped, aux, seqs = sums[:, :-3], sums[:, -3], sums[:, -2], sums[:, -1]
        mean = load.mean(-1, keepdim=True)
        if self.rate and not skipped:
            for layer, lo, mu in zip(self.layers, load, mean, strict=True):
                step = self.rate * torch.sign(mu - lo)
                layer.expert_bias += step.to(layer.expert_bias)
        out = {
            "moe_load_max_mean": [round(float(v), 6) for v in load.max(-1).values / mean[:, 0]],
        }
        if self.balance:
            out.update(
                moe_dropped=[int(v) for v in dropped], moe_aux_loss=float((aux / seqs).mean())
            )
        self.sums = torch.zeros_like(sums)
        return out


def expert_tally(model: nn.Module, train: TrainConfig) -> ExpertTally | None:
    """The tally of `model`'s MoE layers (or a transformers MoE model's routers); None for a
    model without any."""
    tally = ExpertTally(model, train)
    return tally if tally.layers else None
