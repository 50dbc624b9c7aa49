"""One place turns a config into a launchable job.

`shardwise train`, `train --nnodes`, `shardwise profile`, `plan --verify` and
`shardwise.train()` all call `prepare` (or, for candidates that are only measured, its first
step `validate`), so a job one entry point refuses is refused by every one, with the same
message: validate and derive the config for the world size, prepare the data once, check
that the checkpoint it would resume fits the model and the data, predict
memory and step time, refuse what will not fit (memory: `force` overrides; disk), print the
plan, and hold the run-dir lock until the job ends.

The ranks receive the derived run description (`PreparedJob.derived`) and validate nothing
again. Where no launcher of ours prepared the job (ranks started by torchrun or srun, a
test's own world), `validate_here` runs the same checks in each rank before it joins the
process group. Every rank runs its part of the job inside `job_here`, which also takes the
locks where no launcher holds them: global rank 0, before it joins the process group, so
`training/runtime.build_run` locks nothing."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

from shardwise.config import Config
from shardwise.errors import ConfigError
from shardwise.training.validate import Derived, derive


@dataclass
class PreparedJob:
    """A config checked for `world` ranks, its derived values and its plan record; while
    entered, it holds the locks of the job's directories."""

    cfg: Config
    world: int
    derived: Derived
    record: dict
    locks: list[IO[str]] = field(default_factory=list)

    def __enter__(self) -> PreparedJob:
        return self

    def __exit__(self, *exc: object) -> None:
        from shardwise.training.lock import HELD_ENV, release

        if self.locks:
            os.environ.pop(HELD_ENV, None)
        release(self.locks)


def validate(cfg: Config, world: int) -> Derived:
    """Every config error of a job of `world` ranks that needs neither data nor a plan."""
    return derive(cfg, world)


def check_data(cfg: Config, derived: Derived) -> None:
    """Prepare the data once (tokenizer, cache; safe from every rank at once) and check that
    its held-out split gives every data-parallel rank a sample."""
    from shardwise.data import data_spec, load_held_out, prepare_data
    from shardwise.training.validate import check_held_out

    spec, labelled = derived.spec, derived.family.classifier
    prepare_data(data_spec(cfg, spec.vocab_size, labelled))  # the cache, once, not per rank
    check_held_out(cfg, derived, load_held_out(cfg, spec.vocab_size, labelled))


def validate_here(cfg: Config) -> Derived:
    """The checks of a job no launcher of ours prepared (torchrun, srun, a test's own world),
    in the process about to train, before it joins the process group: `validate` for the
    world it joins, then its data. Returns the run description `build_run` takes."""
    from shardwise.distributed.join import joining_world

    derived = validate(cfg, joining_world())
    check_data(cfg, derived)
    return derived


def lock_here(cfg: Config) -> list[IO[str]]:
    """The run-dir and checkpoint-dir locks of a job whose launcher holds none (torchrun,
    srun, one node of `train --nnodes`, a test's own world), taken by global rank 0 before it
    joins the process group; [] on every other rank and where a launcher of ours holds them."""
    from shardwise.distributed.join import joining_rank
    from shardwise.training.lock import HELD_ENV, acquire

    if os.environ.get(HELD_ENV) == "1" or joining_rank() != 0:
        return []
    return acquire(cfg)  # one live job per run.dir and checkpoint.dir (refused: never joined)


@contextmanager
def job_here(cfg: Config, derived: Derived | None = None) -> Iterator[Derived]:
    """This rank's part of the job: the run description (`derived` as the job layer handed
    it, else `validate_here`'s), with the directories locked (`lock_here`) until the block
    ends, however it ends. A rank builds (`build_run`) and trains inside it."""
    from shardwise.training.lock import release

    derived = validate_here(cfg) if derived is None else derived
    locks = lock_here(cfg)
    try:
        yield derived
    finally:
        release(locks)


T = TypeVar("T")


def run_job_here(cfg: Config, derived: Derived | None, body: Callable[..., T]) -> T:
    """This rank's part of the job: inside `job_here`, the run built from its description,
    `body(run)`, and the run closed, with the error that ended it if one did."""
    from shardwise.training.runtime import build_run

    with job_here(cfg, derived) as described:
        run = build_run(cfg, described)
        try:
            out = body(run)
        except BaseException as exc:
            run.close(exc)
            raise
        run.close()
    return out


def prepare(
    cfg: Config,
    world: int,
    *,
    force: bool = False,
    plan_auto: bool = False,
    lock: bool = True,
    show: bool = True,
) -> PreparedJob:
    """The job `cfg` on `world` ranks, ready to launch, or one `ShardwiseError` saying why not.

    `force`: start even if the plan predicts more memory than this machine has. `plan_auto`:
    take the planner's best layout first (`--plan auto`). `lock`: hold the run-dir and
    checkpoint-dir locks from here (not for one node of a multi-node job: global rank 0
    takes them there). `show`: print the plan line."""
    from shardwise.checkpoint.precheck import check_resume
    from shardwise.job.explain import explain_record, print_plan

    if plan_auto:
        from shardwise.job.auto import auto_config

        cfg = auto_config(cfg, world)
    derived = validate(cfg, world)
    check_data(cfg, derived)
    # the checkpoint it would resume fits (its index only), not per rank
    check_resume(cfg, derived.spec)
    record = explain_record(cfg, world)
    if show:
        print_plan(record)
    if not force:  # refused here, not OOM-killed without a word an hour in
        from shardwise.job.auto import refuse_if_too_big

        refuse_if_too_big(cfg, record, world)
    _check_disk(cfg, record)
    job = PreparedJob(cfg, world, derived, record)
    if lock:
        from shardwise.training.lock import HELD_ENV, acquire

        job.locks = acquire(cfg)  # one live job per run.dir and checkpoint.dir
        os.environ[HELD_ENV] = "1"  # the ranks (restarted ones too) know it is held
    return job


def _check_disk(cfg: Config, record: dict) -> None:
    """Room for a checkpoint, checked now rather than found missing at the first save."""
    if not cfg.checkpoint.every:
        return
    from shardwise.checkpoint.io import check_room
    from shardwise.checkpoint.lineage import alive_at_once
    from shardwise.job.explain import checkpoint_bytes

    root = Path(cfg.checkpoint.dir or Path(cfg.run.dir) / "checkpoints")
    # those kept plus the one being written, not one alone
    check_room(root, checkpoint_bytes(record), "checkpoint.dir", alive_at_once(cfg))


def check_restarts(raw: object, cfg: Config, external: bool = False) -> int:
    """`--max-restarts` (the text or number given) as a count, checked against the config:
    restarts continue from the newest checkpoint, so they need checkpoints and resume=auto;
    under torchrun or srun the launcher restarts the ranks instead."""
    try:
        k = int(str(raw))
    except ValueError:
        k = -1
    if k < 0:
        raise ConfigError(
            f"--max-restarts {raw!r} must be a whole number >= 0. Fix: --max-restarts 3"
        )
    if not k:
        return 0
    if external:
        raise ConfigError(
            "--max-restarts is for the ranks shardwise starts itself; under torchrun or srun "
            "the launcher restarts them. Fix: pass --max-restarts to torchrun (and keep "
            "--checkpoint.resume=auto)."
        )
    if not cfg.checkpoint.every:
        raise ConfigError(
            f"--max-restarts {k} restarts from the newest checkpoint, but checkpoint.every=0 "
            "saves none. Fix: also pass --checkpoint.every=N."
        )
    if cfg.checkpoint.resume != "auto":
        raise ConfigError(
            f"--max-restarts {k} needs checkpoint.resume=auto to continue from the newest "
            f"checkpoint, not '{cfg.checkpoint.resume}'. Fix: --checkpoint.resume=auto."
        )
    return k
