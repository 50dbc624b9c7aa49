"""The PyTorch peers run on exactly our model, data order, optimizer and schedule, so their
numbers are oracles for ours (docs/design.md: tests and benchmarks compare against them)."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from shardwise.config import Config
from shardwise.data import GlobalSampler, load_data, split_for_rank
from shardwise.distributed import device as dev
from shardwise.finetune.lora import apply_lora
from shardwise.models import build_model, init_weights
from shardwise.optim import adamw, lr_at
from shardwise.training.runtime import data_spec, freeze, init_distributed
from shardwise.training.validate import derive


def _compress_like(ddp: DistributedDataParallel, cfg: Config) -> None:
    """DDP's own communication hook for `parallel.grad_compression` (none: its default)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    kind = cfg.parallel.grad_compression
    if kind in ("bf16", "fp16"):
        ddp.register_comm_hook(None, getattr(default_hooks, f"{kind}_compress_hook"))
    elif kind == "powersgd":
        # DDP's hook runs plain all-reduces until start_powerSGD_iter, at least 2 with error
        # feedback and warm start; ours compresses from the first step
        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.parallel.powersgd_rank,
            start_powerSGD_iter=2,
            warm_start=cfg.parallel.powersgd_warm_start,
            random_seed=cfg.train.seed,
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)


def ddp_peer(cfg: Config) -> dict:
    """Train `cfg` (data parallel, fp32) with torch's DistributedDataParallel (and its
    compression hook for `parallel.grad_compression`)."""
    info = init_distributed(cfg)  # a torch peer: writes nothing in run.dir, so no job_here lock
    d = derive(cfg, dist.get_world_size())
    data = load_data(data_spec(cfg, d.spec.vocab_size), "train")
    with torch.device(info.device):
        model = build_model(d.spec)
        apply_lora(model, cfg.finetune)  # peft's adapters, as the engine adds them
    freeze(model, cfg.train.freeze)
    if d.family.from_checkpoint:  # a checkpoint: its weights, a new head from (seed, name)
        from shardwise.models.hf.auto import weight_source
        from shardwise.models.hf.weights import load_weights

        load_weights(model, weight_source(d.spec, model), cfg.train.seed)
    else:
        init_weights(model, cfg.train.seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
    _compress_like(ddp, cfg)
    o = cfg.optim
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    opt = adamw(decay, no_decay, cfg)
    sampler = GlobalSampler(len(data), cfg.train.global_batch, cfg.train.seed)
    rank_count = cfg.train.global_batch // d.dp * d.tokens_per_sample
    losses, times = [], []
    for step in range(cfg.train.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        t0 = time.perf_counter()
        micro = split_for_rank(sampler.global_indices(step), dist.get_rank(), d.dp, d.micro_batch)
        total = torch.zeros(())
        for i, idx in enumerate(micro):
            x, y = (t.to(info.device) for t in data.get_batch(idx))
            ctx = ddp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext()
            with ctx:
                logits = ddp(x)
                # DDP averages gradients over ranks, so each rank normalises by its own count.
                loss = (
                    F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="sum")
                    / rank_count
                )
                loss.backward()
            total += loss.detach()
        if o.grad_clip > 0:
            # The same clipping recipe as ours: the norm accumulated in fp64 (torch's default
            # fp32 norm is ~1e-6 off, which Adam amplifies on near-zero coordinates), then
            # torch's own scaling. What is compared is DDP's gradient synchronisation.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
            total_norm = torch.stack(norms).square().sum().sqrt()
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), o.grad_clip, total_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dev.synchronize(info)
        times.append(time.perf_counter() - t0)
        dist.all_reduce(total)
        losses.append(float(total) / d.dp)
    params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "step_times": times}
