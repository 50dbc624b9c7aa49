"""Joining the job's process group: from the launcher's environment (torchrun, torch elastic,
srun, our own launchers) when present, else a one-rank group, so 1 and N ranks run the same
code. Device and backend come from device.py; the rendezvous stores from comm.py."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from shardwise.distributed import device as dev
from shardwise.distributed.store import BIND_ENV, rank_store
from shardwise.errors import ConfigError

JOIN_S = 60.0  # how long ranks started by hand wait for each other


def join_process_group(device: str, timeout_s: float) -> dev.DeviceInfo:
    """Join (once) the process group of this rank's job on `device` (run.device) with
    collectives timing out after `timeout_s`; returns the device this rank computes on."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    info = dev.detect(device, local_rank)
    if dist.is_initialized():
        return info
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        store = None  # env:// (torchrun, srun, or the agent's store shared with the ranks)
        if os.environ.get(BIND_ENV) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # started by our launcher without the agent's store: rank 0 hosts one, not on
            # every interface as env:// would
            store = rank_store(timeout_s)
        elif not ("TORCHELASTIC_RUN_ID" in os.environ or "SLURM_PROCID" in os.environ):
            # RANK/WORLD_SIZE by hand (or left over in the shell): join within a bound
            store = _join_by_hand(timeout_s)
        if store is None:
            dist.init_process_group(info.backend, timeout=timeout)
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(
                info.backend, store=store, rank=rank, world_size=world, timeout=timeout
            )
    else:
        dist.init_process_group(
            info.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return info


def joining_world() -> int:
    """The number of ranks `join_process_group` joins (or has joined): the launcher's
    WORLD_SIZE, else one."""
    if dist.is_initialized():
        return dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def joining_rank() -> int:
    """This process's global rank in the group `join_process_group` joins (or has joined):
    the launcher's RANK, else zero."""
    if dist.is_initialized():
        return dist.get_rank()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return 0


def _join_by_hand(timeout_s: float):
    """The store of ranks started without torchrun or srun, from RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT: rank 0 hosts it on MASTER_ADDR and waits for the others up to
    a minute, then says what is wrong instead of waiting parallel.timeout_s for each step."""
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    shown = " ".join(f"{k}={v}" for k, v in env.items() if v is not None)
    fix = (
        "Fix: unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT (shardwise train "
        "--nproc N starts the ranks itself), or start every rank of the world."
    )
    if not env["MASTER_ADDR"] or not env["MASTER_PORT"]:
        raise ConfigError(f"{shown} are set, but not MASTER_ADDR and MASTER_PORT. {fix}")
    join = min(JOIN_S, timeout_s)
    try:
        return rank_store(join, wait_for_all=True)
    except (RuntimeError, OSError) as exc:  # torch's DistStoreError is a RuntimeError
        raise ConfigError(
            f"{shown} are set in the environment, but no torchrun or srun started this "
            f"process and the world's other ranks did not join within {join:g} s ("
            f"{str(exc).splitlines()[0][:120]}): a stale environment? {fix}"
        ) from None
