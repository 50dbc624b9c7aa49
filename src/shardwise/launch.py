"""Starting ranks: through torch's elastic launcher for local runs, or joining the ranks an
external `torchrun` / `srun` already started. No launcher protocol of our own."""

from __future__ import annotations

import os
import socket
import sys
import uuid

from shardwise.config import Config, config_from_dict
from shardwise.errors import ShardwiseError


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


def rank_main(cfg_dict: dict) -> None:
    """Entry point of every rank (picklable, so the elastic launcher can start it)."""
    import torch.distributed as dist

    from shardwise.runtime import build_run
    from shardwise.train import fit

    cfg = config_from_dict(cfg_dict)
    try:
        fit(build_run(cfg))
    except ShardwiseError as exc:
        rank = os.environ.get("RANK", "0")
        print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_local(cfg: Config, nproc: int) -> None:
    """Run `nproc` ranks on this machine (in-process when nproc == 1)."""
    if nproc == 1:
        rank_main(cfg.to_dict())
        return
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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
    try:
        elastic_launch(config, rank_main)(cfg.to_dict())
    except ChildFailedError as exc:
        codes = sorted({f.exitcode for f in exc.failures.values()})
        ranks = sorted(exc.failures)
        raise ShardwiseError(
            f"rank(s) {ranks} failed with exit code(s) {codes}; their messages are printed above."
        ) from None
