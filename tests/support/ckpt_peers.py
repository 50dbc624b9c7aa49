"""PyTorch Distributed Checkpoint (DCP) as the peer of our checkpoint saves, for
benchmarks/checkpoint_async.py: the same model and AdamW state, saved by `dcp.save` and by
`dcp.async_save` (its stall: the time until it returns and training could go on)."""

from __future__ import annotations

import tempfile
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardwise.config import Config


def dcp_peer(cfg: Config, rounds: int = 3) -> dict:
    """Train `train.steps` steps data parallel (no checkpoints of ours), then time DCP saves
    of the model and optimizer state; returns the seconds per save, sync and async stall."""
    from dataclasses import replace

    from shardwise.job.prepare import run_job_here

    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, every=0, resume="none"))
    return run_job_here(cfg, None, lambda run: _time_dcp_saves(run, rounds))


def _time_dcp_saves(run, rounds: int) -> dict:
    """`dcp_peer`'s body: train, then time `rounds` sync and async DCP saves of the state."""
    from shardwise.training.loop import fit

    cfg = run.cfg
    fit(run)
    state = {"model": run.model.state_dict(), "optim": run.optimizer.inner.state_dict()}
    group = dist.new_group(backend="gloo")  # async saves coordinate off the training groups
    root = tempfile.mkdtemp(prefix="dcp-peer-", dir=cfg.run.dir if cfg.run.dir else None)
    sync, stall, total = [], [], []
    for i in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=f"{root}/sync{i}")
        sync.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=f"{root}/async{i}", process_group=group)
        stall.append(time.perf_counter() - t0)
        future.result()
        total.append(time.perf_counter() - t0)
    return {"dcp_sync_s": sync, "dcp_async_stall_s": stall, "dcp_async_total_s": total}
