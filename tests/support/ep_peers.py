"""Expert-parallel runs that also report their routing, run inside a `run_world` world as
`peer` cases: each MoE layer's per-expert counts on every rank and forward, from which the test
computes the rows each rank sent to (and received from) the other ep ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.config import Config
from shardwise.job.prepare import run_job_here
from shardwise.models.moe import moe_layers
from shardwise.training.loop import fit


def routed_rows(cfg: Config) -> dict:
    """Train as the config says; return the records and, per optimizer step, the rows this
    rank sent to other ep ranks' experts and received from them (summed over layers and
    micro-batches), computed from every rank's per-expert loads. Dropless; a forward that
    recomputation replays inside backward is not counted again (the planner's formula
    prices the replay from the forward's rows)."""
    loads: list[torch.Tensor] = []

    def tally(m, args, out) -> None:
        if torch._C._current_graph_task_id() == -1:  # not a replay inside backward
            loads.append(m.last[: m.n_experts].clone())

    def tallied_fit(run) -> list[dict]:
        for layer in moe_layers(run.model):
            layer.register_forward_hook(tally)
        return fit(run)

    records = run_job_here(cfg, None, tallied_fit)
    mine = torch.stack(loads).cpu()  # [forwards, E]: this rank's chosen counts per expert
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    ep, rank = cfg.parallel.ep, dist.get_rank()  # tp = pp = 1: the dp coordinate is the rank
    group = range(rank - rank % ep, rank - rank % ep + ep)  # this rank's run of ep ranks
    per = mine.shape[1] // ep
    own = slice((rank % ep) * per, (rank % ep + 1) * per)
    sent = mine.sum(1) - mine[:, own].sum(1)
    received = sum(every[r][:, own].sum(1) for r in group if r != rank)
    steps = len(records)
    return {
        "records": records,
        "losses": [r["loss"] for r in records],
        "sent": [float(v) for v in sent.view(steps, -1).sum(1)],
        "received": [float(v) for v in received.view(steps, -1).sum(1)],
    }


def first_grads(cfg: Config) -> dict:
    """One optimizer step; return every parameter's reduced gradient of that step at full
    shape (ZeRO-0: each rank holds them whole; expert slices gathered over ep), taken just
    before the optimizer uses it, and the step's loss."""
    return run_job_here(cfg, None, _first_grads)


def _first_grads(run) -> dict:
    """`first_grads`'s body on the built run."""
    grads: dict[str, torch.Tensor] = {}
    step = run.optimizer.step

    def capture(*args, **kwargs):
        if not grads:
            for t in run.optimizer.targets:
                grads[t.name] = t.grad().detach().float().clone()
        return step(*args, **kwargs)

    run.optimizer.step = capture
    records = fit(run)
    if run.expert_parallel is not None:
        grads = run.expert_parallel.full_parameters(grads, run.info.device)
    return {"losses": [r["loss"] for r in records], "grads": {k: v.cpu() for k, v in grads.items()}}
