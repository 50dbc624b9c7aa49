"""Starting ranks: through torch's elastic launcher for local runs, or joining the ranks an
external `torchrun` / `srun` already started. No launcher protocol of our own."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from typing import TYPE_CHECKING

from shardwise.config import Config, config_from_dict
from shardwise.errors import ShardwiseError

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig


def under_external_launcher() -> bool:
    """True inside torchrun/torch elastic (RANK set) or a multi-task srun step."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def adopt_slurm_env() -> None:
    """Map one-task-per-rank srun variables onto the env:// rendezvous torch expects."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        raise ShardwiseError(
            "running under srun without MASTER_ADDR. Fix: export MASTER_ADDR="
            "$(scontrol show hostnames $SLURM_NODELIST | head -n1) before srun."
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_here(cfg: Config) -> None:
    """Train as one rank of the current job (errors propagate to the caller)."""
    import torch.distributed as dist

    from shardwise.runtime import build_run
    from shardwise.train import fit

    try:
        fit(build_run(cfg))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_main(cfg_dict: dict) -> None:
    """Entry point of every rank the elastic launcher starts (picklable). A user error is
    printed once, by the rank that hit it, without a traceback."""
    try:
        train_here(config_from_dict(cfg_dict))
    except ShardwiseError as exc:
        rank = os.environ.get("RANK", "0")
        print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def launch_local(cfg: Config, nproc: int) -> None:
    """Run `nproc` ranks on this machine (in-process when nproc == 1)."""
    if nproc == 1:
        train_here(cfg)
        return
    from torch.distributed.launcher.api import LaunchConfig

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.2,
    )
    run_elastic(config, cfg)


def run_elastic(config: LaunchConfig, cfg: Config) -> None:
    """Run this node's torch elastic agent with `rank_main` as every rank's entry point; a
    failure becomes one ShardwiseError (the ranks print their own messages)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # The ranks print their own one-line errors; torch elastic would add a traceback per rank.
    quiet = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, rank_main)(cfg.to_dict())
    except ChildFailedError as exc:
        codes = sorted({f.exitcode for f in exc.failures.values()})
        ranks = sorted(exc.failures)
        raise ShardwiseError(
            f"rank(s) {ranks} failed with exit code(s) {codes}; their messages are printed above."
        ) from None
    finally:
        quiet.setLevel(level)
