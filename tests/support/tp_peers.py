"""Tensor-parallel oracles and probes, run inside a `run_world` world as `peer` cases.

* `dtensor_peer`: PyTorch's own tensor parallelism (DTensor `parallelize_module`, with its
  `loss_parallel` vocabulary-parallel loss) on exactly our reference model, data order,
  AdamW groups, schedule, loss normalisation and clipping (tp only: dp = 1).
* `layer_probe`: one transformer block's forward+backward with our tensor parallelism:
  tp bytes sent (Comm's counters) and bytes saved for backward (ActivationMeter), with and
  without sequence parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from shardwise.config import Config
from shardwise.data import GlobalSampler, load_data, split_for_rank
from shardwise.distributed import device as dev
from shardwise.job.prepare import run_job_here
from shardwise.models import build_model, init_weights
from shardwise.models.families import DECODER
from shardwise.optim import adamw, lr_at
from shardwise.training.runtime import data_spec, init_distributed
from shardwise.training.validate import derive


def dtensor_plan(n_layers: int) -> dict:
    """torch's styles for our decoder: the same split as `models.tp_plans.DECODER`."""
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(n_layers):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.w2"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def _clip(params: list, max_norm: float, mesh) -> None:
    """Our clipping recipe (fp64 norm; sharded gradients summed over tp, replicated once)."""
    sharded = torch.zeros((), dtype=torch.float64)
    other = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, DTensor):
            sq = g.to_local().double().square().sum()
            if any(isinstance(pl, Shard) for pl in g.placements):
                sharded += sq
                continue
            other += sq
        else:
            other += g.double().square().sum()
    dist.all_reduce(sharded, group=mesh.get_group())
    norm = float((sharded + other).sqrt())
    if norm > max_norm:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))


def dtensor_peer(cfg: Config) -> dict:
    """Train `cfg` (tp = world size, fp32) with DTensor tensor parallelism."""
    info = init_distributed(cfg)  # a torch peer: writes nothing in run.dir, so no job_here lock
    d = derive(cfg, dist.get_world_size())
    if d.dp != 1 or d.family is not DECODER:  # the plan below is our Llama block's
        raise ValueError("the DTensor peer runs the reference decoder with tp only")
    mesh = init_device_mesh(info.type, (d.tp,), mesh_dim_names=("tp",))
    data = load_data(data_spec(cfg, d.spec.vocab_size), "train")
    with torch.device(info.device):
        model = build_model(d.spec)
    init_weights(model, cfg.train.seed)
    parallelize_module(model, mesh, dtensor_plan(d.spec.n_layers))
    params = list(model.parameters())
    opt = adamw([p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2], cfg)
    sampler = GlobalSampler(len(data), cfg.train.global_batch, cfg.train.seed)
    count = cfg.train.global_batch * d.tokens_per_sample
    losses, times = [], []
    for step in range(cfg.train.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        t0 = time.perf_counter()
        total = 0.0
        for idx in split_for_rank(sampler.global_indices(step), 0, 1, d.micro_batch):
            x, y = (t.to(info.device) for t in data.get_batch(idx))
            logits = model(x)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum") / count
                loss.backward()
            loss = loss.detach()
            total += float(loss.full_tensor() if isinstance(loss, DTensor) else loss)
        if cfg.optim.grad_clip > 0:
            _clip(params, cfg.optim.grad_clip, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dev.synchronize(info)
        times.append(time.perf_counter() - t0)
        losses.append(total)
    full = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
        for n, p in model.named_parameters()
    }
    return {"losses": losses, "params": full, "step_times": times}


def layer_probe(cfg: Config) -> dict:
    """tp bytes and saved-activation bytes of one block (blocks.0) forward+backward on an
    input [micro_batch, seq_len, dim], with sequence parallelism off and on."""
    out = {}
    for sp in (False, True):
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sp=sp))
        out["sp" if sp else "tp"] = run_job_here(c, None, functools.partial(_probe_block, sp=sp))
    return out


def _probe_block(run, sp: bool) -> dict:
    """`layer_probe`'s measurement of blocks.0 on the built run (`sp`: sequence parallel)."""
    b, s, h = run.derived.micro_batch, run.cfg.data.seq_len, run.derived.spec.dim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, h, generator=gen).to(run.info.device)
    t, r = run.topo.tp, run.topo.coord("tp")
    if sp and t > 1:
        x = x.chunk(t, dim=1)[r].contiguous()  # the sequence-sharded residual stream
    x.requires_grad_(True)
    block = run.model.blocks[0]
    run.comm.take_step_bytes()
    with run.meter.measure():
        y = block(x)
    saved = run.meter.take_peak()
    run.reducer.sync = False  # gradients stay local: only the block's tp traffic counts
    y.float().square().sum().backward()
    return {
        "activations": saved,
        "tp_bytes": run.comm.take_step_bytes()["tp"],
        "b": b,
        "s": s,
        "h": h,
        "t": t,
    }
