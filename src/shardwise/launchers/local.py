"""Starting ranks: through torch's elastic launcher for local runs, or joining the ranks an
external `torchrun` / `srun` already started. No launcher protocol of our own."""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.checkpoint.manager import SIGNAL_GRACE_S
from shardwise.config import Config, config_from_dict
from shardwise.distributed.store import BIND_ENV, free_port
from shardwise.distributed.watchdog import EXIT_HANG, LOCAL_LAUNCH_ENV, REPORT
from shardwise.errors import ReportedError, ShardwiseError
from shardwise.launchers import rendezvous
from shardwise.launchers.process_exit import skip_exit_collection
from shardwise.launchers.rank_start import PRELOAD, as_rank, fresh_forkserver
from shardwise.training.lock import HELD_ENV, acquire, release
from shardwise.training.preempt import Preempted, preempt_code

SHUTDOWN_GRACE_S = SIGNAL_GRACE_S  # torch elastic's wait for signalled ranks to save and exit
SCRATCH_PREFIX = "shardwise-elastic-"  # torch elastic's folder for one launch (`scratch_logs`)

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

    from shardwise.training.validate import Derived


# launcher variables read as integers: (lowest value, what it is, an example)
INT_ENV = {
    "RANK": (0, "this rank's index", "0"),
    "WORLD_SIZE": (1, "the number of ranks", "2"),
    "LOCAL_RANK": (0, "this rank's index on its node", "0"),
    "LOCAL_WORLD_SIZE": (1, "the ranks on this node", "2"),
    "MASTER_PORT": (1, "the rendezvous port", "29500"),
    "SLURM_NTASKS": (1, "srun's task count", "2"),
    "SLURM_PROCID": (0, "srun's task index", "0"),
    "SLURM_LOCALID": (0, "srun's task index on its node", "0"),
    "SLURM_NTASKS_PER_NODE": (1, "srun's tasks per node", "2"),
}


def check_launch_env() -> None:
    """Refuse launcher and thread variables that would fail later as a raw ValueError (an
    `int()` deep in the rendezvous) or silently slow every rank (OMP_NUM_THREADS=0: libgomp
    warns, then runs one thread per core in each rank)."""
    for name, (low, what, example) in INT_ENV.items():
        value = os.environ.get(name)
        if value is None:
            continue
        if not value.strip().isdigit() or int(value) < low:
            kind = "a positive" if low else "a non-negative"
            unset = name if name.startswith("SLURM") else "RANK WORLD_SIZE LOCAL_RANK"
            raise ShardwiseError(
                f"{name}={value!r} is not {kind} integer ({what}). Fix: export "
                f"{name}={example} (as torchrun sets it), or unset {unset} and let "
                "`shardwise train --nproc N` start the ranks."
            )
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None and int(rank) >= int(world):
        raise ShardwiseError(
            f"RANK={rank} is not below WORLD_SIZE={world} (ranks are 0..WORLD_SIZE-1). Fix: "
            "export them as the launcher would, or unset both to let shardwise start the ranks."
        )
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is not None:
        parts = threads.split(",")
        if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise ShardwiseError(
                f"OMP_NUM_THREADS={threads!r} is not a positive thread count: OpenMP ignores "
                "it and every rank then runs one thread per core (many times slower with "
                "several ranks). Fix: export OMP_NUM_THREADS=1, or unset it."
            )


def under_external_launcher() -> bool:
    """True inside torchrun/torch elastic (RANK set) or a multi-task srun step. The launcher
    variables are checked first (`check_launch_env`)."""
    check_launch_env()
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
    if "SLURM_NTASKS_PER_NODE" in os.environ:  # run.cpu_affinity shares a node's cores
        os.environ["LOCAL_WORLD_SIZE"] = os.environ["SLURM_NTASKS_PER_NODE"]
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        raise ShardwiseError(
            "running under srun without MASTER_ADDR. Fix: export MASTER_ADDR="
            "$(scontrol show hostnames $SLURM_NODELIST | head -n1) before srun."
        )


def train_here(cfg: Config, hook: str | None = None, derived: Derived | None = None) -> None:
    """Train as one rank of the current job (errors propagate to the caller). `hook`
    ("module:function") is applied to the built run first: tests inject faults with it.
    `derived`: the run description the job layer validated (`job.prepare`); None where no
    launcher of ours prepared the job (torchrun, srun): its checks run here, before this rank
    joins the process group. Where no launcher holds the run-dir lock, global rank 0 takes it
    here, also before joining (`job.prepare.job_here`)."""
    import torch.distributed as dist

    from shardwise.job.prepare import run_job_here
    from shardwise.training.loop import fit

    def body(run) -> None:
        if hook:
            module, _, name = hook.partition(":")
            getattr(importlib.import_module(module), name)(run)
        fit(run)

    try:
        run_job_here(cfg, derived, body)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_main(
    cfg_dict: dict, hook: str | None = None, local: bool = False, derived: Derived | None = None
) -> None:
    """Entry point of every rank the elastic launcher starts (picklable). A user error is
    printed once, by the rank that hit it, without a traceback. `local`: started by
    `launch_local`, which prints a hang report itself. `derived`: as for `train_here`."""
    if local:
        os.environ[LOCAL_LAUNCH_ENV] = "1"
    try:
        train_here(config_from_dict(cfg_dict), hook, derived)
    except Preempted as exc:  # saved: the documented status, no traceback; rank 0 says why
        if os.environ.get("RANK", "0") == "0" and not local:  # (else launch_local does)
            print(f"shardwise: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.code) from None
    except ShardwiseError as exc:
        rank = os.environ.get("RANK", "0")
        if rank == "0" or not getattr(exc, "every_rank", False):  # the same on all: once
            print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def rank_process_main(
    cfg_dict: dict, hook: str | None = None, local: bool = False, derived: Derived | None = None
) -> None:
    """`rank_main` as the whole of a process torch elastic starts: the process ends with it,
    without the exit-time garbage collections (launchers/process_exit.py)."""
    as_rank()
    skip_exit_collection()
    try:
        rank_main(cfg_dict, hook, local, derived)
    finally:  # a rank forked from the launch's server ends without Python's shutdown
        atexit._run_exitfuncs()


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def launch_local(
    cfg: Config,
    nproc: int,
    hook: str | None = None,
    max_restarts: int = 0,
    derived: Derived | None = None,
) -> None:
    """Run `nproc` ranks on this machine (in-process when nproc == 1 and nothing needs
    restarting). A job stopped by the hang watchdog fails with its report as the message.
    After a failure torch elastic stops every rank and starts them all again, up to
    `max_restarts` times; they resume from the newest valid checkpoint. `derived`: the job
    layer's run description for `nproc` ranks, handed to every rank (None: each validates)."""
    check_launch_env()
    if nproc == 1 and not max_restarts:
        train_here(cfg, hook, derived)
        return
    from torch.distributed.launcher.api import LaunchConfig

    if max_restarts:
        # Restarted ranks must not see the previous attempt's keys: with the rendezvous store
        # shared by the agent they would (new_group then waits forever; pytorch#135712).
        # Opting out gives every attempt a fresh store hosted by its rank 0.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

    # one live job per run.dir: refused before any rank starts (the job layer normally holds
    # it already); the ranks (restarted ones too) know the lock is held
    held = [] if os.environ.get(HELD_ENV) == "1" else acquire(cfg)
    os.environ[HELD_ENV] = "1"
    os.environ[BIND_ENV] = "1"
    try:  # (the config makes its scratch folder: only for a job that is not refused)
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=uuid.uuid4().hex[:8],
            # torch's c10d rendezvous with its stores on loopback only (launchers/rendezvous.py)
            rdzv_backend=rendezvous.register(),
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            local_addr="127.0.0.1",  # the ranks' MASTER_ADDR: their own store on loopback too
            max_restarts=max_restarts,
            monitor_interval=0.2,
            logs_specs=scratch_logs(),
            # a signal to this agent is forwarded to the ranks, which finish their step and save
            # (training/preempt.py) before torch elastic would kill them
            shutdown_timeout=SHUTDOWN_GRACE_S,
        )
        run_elastic(config, cfg, hook, local=True, derived=derived)
    finally:
        if held:
            os.environ.pop(HELD_ENV, None)
        os.environ.pop(BIND_ENV, None)
        release(held)


def _stopped(cfg: Config, signum: int, since: float = 0.0) -> Preempted:
    """The ranks stopped on `signum`: saved if the newest checkpoint was committed after
    `since` (the job's start), else stopped before saving any (a checkpoint of an earlier
    job is not this one's)."""
    from shardwise.checkpoint import io as cio

    root = Path(cfg.checkpoint.dir or Path(cfg.run.dir) / "checkpoints")
    newest = cio.latest(root)
    step = int(newest.name.rpartition("-")[2]) if newest is not None else None
    saved = newest is not None and (newest / cio.INDEX).stat().st_mtime >= since
    metrics = str(Path(cfg.run.dir) / "metrics.jsonl")
    return Preempted(signum, step, str(newest) if newest else None, saved, metrics)


class _DeathSignalNote(logging.Filter):
    """torch elastic's warning that it forwards a signal: here that is the expected path."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in record.getMessage()


def _first_line(message: object) -> str:
    """The first line of a failure's message (torch elastic keeps a str or a dict)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message).strip()
    return text.splitlines()[0][:400] if text else ""


def scratch_logs():
    """torch elastic's folder for one launch (its ranks' error files), a temporary one that
    `run_elastic` removes when the launch ends: torch's default is a new folder in the
    temporary directory per launch, never removed."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    return DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix=SCRATCH_PREFIX))


def run_elastic(
    config: LaunchConfig,
    cfg: Config,
    hook: str | None = None,
    local: bool = False,
    derived: Derived | None = None,
) -> None:
    """Run this node's torch elastic agent with `rank_process_main` as every rank's entry; a
    failure becomes one ShardwiseError (the ranks print their own messages). `local`: every
    rank is on this machine, so a hang report in run.dir is printed here, not by a rank.
    `derived`: the job layer's run description, handed to every rank (restarted ones too).
    `config.logs_specs` is a `scratch_logs()` folder: it is removed at the end."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # The ranks print their own one-line errors; torch elastic would add a traceback per rank.
    quiet = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    drop = _DropAll()  # a filter, not a level: two launches in one process must not race
    quiet.addFilter(drop)
    agent, note = (
        logging.getLogger("torch.distributed.elastic.agent.server.api"),
        _DeathSignalNote(),
    )
    agent.addFilter(note)
    started = time.time()
    try:
        with fresh_forkserver([*PRELOAD, __name__]) as method:
            config = dataclasses.replace(config, start_method=method)
            elastic_launch(config, rank_process_main)(cfg.to_dict(), hook, local, derived)
    except SignalException as exc:  # the agent was signalled; its ranks saved and stopped
        # while the handler is still held here: torch leaves its keep-alive thread running
        rendezvous.stop_heartbeats()
        raise _stopped(cfg, int(exc.sigval), started) from None
    except ChildFailedError as exc:
        codes = sorted({f.exitcode for f in exc.failures.values()})
        ranks = sorted(exc.failures)
        stopped = {preempt_code(c) for c in codes}
        if None not in stopped:  # every failed rank stopped on a signal after saving
            raise _stopped(cfg, max(stopped), started) from None
        report = Path(cfg.run.dir) / REPORT
        if EXIT_HANG in codes and report.is_file() and report.stat().st_mtime >= started:
            raise ShardwiseError(
                f"the hang watchdog stopped the job: rank(s) {ranks} exited with status(es) "
                f"{codes}.\n{report.read_text()}"
            ) from None
        # A user error (exit 2) was printed by its rank; anything else (a lost peer, a crash)
        # only reached torch elastic's error file, silenced above: show its first line.
        crashes = [
            f"\n  rank {r}: {_first_line(f.message)}"
            for r, f in sorted(exc.failures.items())
            if f.exitcode != 2 and _first_line(f.message)
        ]
        failed = f"rank(s) {ranks} failed with exit code(s) {codes};"
        if codes == [2]:  # every message is on screen already: the CLI adds no line
            raise ReportedError(f"{failed} their messages are printed above.") from None
        shown = "".join(crashes) if crashes else " their messages are printed above."
        raise ShardwiseError(failed + shown) from None
    finally:
        quiet.removeFilter(drop)
        agent.removeFilter(note)
        logs = Path(config.logs_specs.root_log_dir)
        if logs.name.startswith(SCRATCH_PREFIX):  # a folder `scratch_logs` made, none other
            shutil.rmtree(logs, ignore_errors=True)
