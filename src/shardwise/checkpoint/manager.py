"""Saving a run and resuming it, in any layout: `Checkpointer` is what `fit()` calls.

Data order and initialisation depend only on the seed and the global sample index
(docs/design.md), and the index stores the step, the loss scaler and AdamW's step count, so a
resumed run continues as if it had never stopped — bitwise in the same layout. A save is
synchronous, or (`checkpoint.async`) a host snapshot written by a background thread. The steps
of a save on disk (write, commit, prune, one message for any rank's failure) are
checkpoint/saving.py's.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from shardwise.checkpoint import dcp_format, lineage, titan
from shardwise.checkpoint import io as io
from shardwise.checkpoint.refusals import every_rank, order_refusal
from shardwise.checkpoint.saving import attempt, commit, prune, raise_failed, warn, write_files
from shardwise.checkpoint.state import (
    Local,
    adam_step,
    assign_writers,
    build_index,
    load_state,
    local_state,
)
from shardwise.distributed import device as dev
from shardwise.distributed.comm import ControlChannel
from shardwise.errors import CheckpointError

# -- when to save, what to resume ---------------------------------------------------------------
# What the launchers ask of the scheduler (Slurm `--signal=TERM@120`, a pod's
# terminationGracePeriodSeconds, torch elastic's shutdown timeout): seconds between a stop
# signal and the kill, which must cover one step and one save (training/preempt.py). GRACE_ENV
# tells the job, which warns when a save takes more than half of it.
SIGNAL_GRACE_S = 120
GRACE_ENV = "SHARDWISE_SIGNAL_GRACE_S"


def _restart() -> str:
    """How many times torch elastic has restarted this job's ranks ("0": never)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


class Checkpointer:
    """Resumes at the start of `fit()` and saves every `checkpoint.every` steps (and after the
    last one). With `checkpoint.async` the save only snapshots this rank's slices to host
    memory; a background thread writes them and commits while training goes on."""

    def __init__(self, run) -> None:
        self.run, self.cfg = run, run.cfg.checkpoint
        self.root = lineage.checkpoint_root(run.cfg)
        self.rank = run.topo.rank
        self.enabled = self.cfg.every > 0 or self.cfg.resume != "none" or self.cfg.on_signal
        # group creation is collective: every rank makes it here, at the same point
        world = run.topo.world
        self.channel = ControlChannel(world, run.cfg.parallel.timeout_s) if self.enabled else None
        self._host: dict[str, torch.Tensor] = {}  # reused snapshot buffers (pinned on GPUs)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.saving_step = 0
        # the metrics record of the step the resumed checkpoint was saved after: a failure
        # between the save and the log line must not leave that step out of metrics.jsonl
        self.record: dict | None = None
        self.history = lineage.start(None, 0)  # the line this job's saves continue
        self._good: dict[str, bool] = {}  # rank 0: checkpoints this job verified (name: ok)

    # -- resume ---------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the checkpoint `checkpoint.resume` names; returns the step to continue from."""
        mode = self.cfg.resume
        if mode == "none":
            found = io.list_complete(self.root)
            if found and (self.cfg.every or self.cfg.on_signal):
                raise every_rank(CheckpointError(lineage.fresh_refusal(self.root, found[0][0])))
            return 0
        if mode == "auto":
            path = self._newest_valid()
            if path is None:
                if self.rank == 0 and _restart() != "0":
                    print(
                        f"restart {_restart()}: no valid checkpoint in {self.root}, "
                        "starting from step 0",
                        flush=True,
                    )
                return 0
        elif titan.is_titan(mode):
            return self._from_titan(Path(mode))
        else:
            path = self._explicit(Path(mode))
        step = self._load(path)
        self._check_planned(step)
        return step

    def _from_titan(self, path: Path) -> int:
        """Continue a torchtitan step checkpoint (checkpoint/titan.py) as a new line."""
        step, line = titan.load_titan(self.run, path, self.channel)
        self.run.resume_note = line
        self.history = lineage.start(None, step)
        if self.rank == 0:
            print(f"resumed from {path} at step {step} ({line})", flush=True)
        self._check_planned(step)
        return step

    def _problems(self, path: Path) -> list[str]:
        """Every rank checks a share of the files; all ranks get the union (collective)."""
        index, problems = io.check_index(path)
        if index is not None:
            files = sorted(index["files"].items())
            world = self.run.topo.world
            problems += io.check_files(path, dict(files[self.rank :: world]))
        return sorted({p for mine in self.channel.all_gather(problems) for p in mine})

    def _newest_valid(self) -> Path | None:
        if not self.root.is_dir():
            return None
        if self.rank == 0:  # leftovers of a killed save (or deletion) are never loaded
            ours, kept = io.list_unfinished(self.root)
            for left in ours:
                warn(f"removing {left}: an unfinished save of this run (its shards only)")
                io.remove(left)
            for left in kept:
                warn(
                    f"keeping {left}: it looks like an unfinished checkpoint but holds files a "
                    "save does not write, or lost its index.json; it is not loaded and not "
                    "deleted (remove it yourself if it is not needed)"
                )
        self.channel.all_gather(None)  # everyone lists the directory after the clean-up
        order, off = lineage.resume_order(self.root)
        bad = []
        for entry in order:  # `latest` (or a newer save of its line), then its line backwards
            problems = self._problems(entry.path)
            if not problems:
                self._say_off_line(off, entry.path)
                return entry.path
            bad.append(f"\n  {entry.path.name}: " + "; ".join(problems))
            if self.rank == 0:
                warn(f"skipping checkpoint {entry.path}: " + "; ".join(problems))
        if bad:  # starting over would silently throw the run's progress away (gathered: alike)
            others = ", ".join(e.path.name for e in off)
            raise every_rank(
                CheckpointError(
                    f"checkpoint.dir {self.root} holds {len(bad)} checkpoint(s) and none is valid:"
                    f"{''.join(bad)}\n"
                    + (f"Not tried (off the line `latest` names): {others}.\n" if others else "")
                    + "Nothing was changed. Fix: restore a checkpoint, name one with "
                    "--checkpoint.resume=PATH, or start over with --checkpoint.resume=none and "
                    "another --checkpoint.dir."
                )
            )
        return None

    def _say_off_line(self, off: list[lineage.Entry], used: Path) -> None:
        if off and self.rank == 0:
            names = ", ".join(sorted(e.path.name for e in off))
            warn(
                f"not resuming {names} in {self.root}: off the "
                f"line of {used.name}, the newest save (a later point of a run that was resumed "
                "from an earlier step, or another run's); they are kept, never pruned. Name one "
                "with --checkpoint.resume=PATH to continue it instead."
            )

    def _check_planned(self, start: int) -> None:
        """Refuse, before the first step, a line whose planned saves would land on another
        line's valid checkpoints (a damaged one is set aside when its step is saved)."""
        last = start > 0  # a resumed run saves its last step (training/loop.py)
        steps = lineage.planned_saves(start, self.run.cfg.train.steps, self.cfg.every or 0)
        if last and not steps and start < self.run.cfg.train.steps:
            steps = [self.run.cfg.train.steps]
        taken = [p for s, p in io.list_complete(self.root) if s in set(steps)]
        valid = [p for p in taken if not self._problems(p)]
        tmps = [io.step_dir(self.root, s).with_suffix(".tmp") for s in steps]
        blocked = [t for t in tmps if os.path.lexists(t) and not io.ours_leftover(t)]
        if blocked:  # not ours (a link, other files): a save there would be refused mid-run
            raise CheckpointError(
                f"{blocked[0]} is in the way of this run's save of that step and was not "
                "written by a save (a symbolic link, a file or foreign files). Nothing was "
                "changed. Fix: move it away."
            )
        if valid:
            raise CheckpointError(
                f"this run continues from step {start} and would save over "
                f"{', '.join(sorted(p.name for p in valid))} in {self.root}: valid checkpoints of "
                "another line (a later point of the run it rolls back, or another run), which "
                "are never overwritten. Nothing was changed. Fix: --checkpoint.dir=<another "
                "directory> for this line (keeping --checkpoint.resume), or "
                "--checkpoint.resume=auto to continue the newest save."
            )

    def _explicit(self, path: Path) -> Path:
        if not (path / io.INDEX).is_file() and (path / io.LATEST).is_file():
            path = path / (path / io.LATEST).read_text().strip()  # a checkpoint.dir
        problems = self._problems(path)
        if problems:  # gathered: every rank raises it alike
            raise every_rank(
                CheckpointError(
                    f"checkpoint.resume={path} is not a valid checkpoint: {'; '.join(problems)}. "
                    "Fix: name a checkpoint directory (step-NNNNNNNN) or use "
                    "--checkpoint.resume=auto to take the newest valid one."
                )
            )
        return path

    def _load(self, path: Path) -> int:
        index = io.read_index(path)
        refusal = order_refusal(index, self.run.cfg, path)
        if refusal:  # every rank reads the same index
            raise every_rank(CheckpointError(refusal))
        note = self.run.resume_note = load_state(self.run, path, index, self.channel)
        self.history = lineage.start(index, index["step"])  # a new job on that line
        if path.parent.resolve() == self.root.resolve():
            self._good[path.name] = True  # every file's SHA-256 was checked before loading
        self.record = index.get("record")
        scaler, saved = self.run.optimizer.scaler, index["loop"]["loss_scaler"]
        if scaler.enabled and saved["enabled"]:
            scaler.scale, scaler.good_steps = saved["scale"], saved["good_steps"]
        if self.rank == 0:
            was, now = index["layout"], self.run.derived
            after = f" after restart {_restart()}" if _restart() != "0" else ""
            saved = " ".join(f"{k} {was[k]}" for k in ("world", "dp", "tp", "pp", "zero"))
            here = f"world {now.world} dp {now.dp} tp {now.tp} pp {now.pp} zero "
            here += str(self.run.cfg.parallel.zero)
            if max(was.get("cp", 1), now.cp) > 1:  # (older checkpoints: cp 1, not recorded)
                saved, here = f"{saved} cp {was.get('cp', 1)}", f"{here} cp {now.cp}"
            if max(was.get("ep", 1), now.ep) > 1:  # (likewise ep)
                saved, here = f"{saved} ep {was.get('ep', 1)}", f"{here} ep {now.ep}"
            print(
                f"resumed{after} from {path} at step {index['step']} (saved with {saved}; "
                f"now {here})" + (f"; {note}" if note else ""),
                flush=True,
            )
        return index["step"]

    # -- save -----------------------------------------------------------------------------------
    def maybe_save(self, step: int, record: dict, force: bool = False) -> None:
        """Save after `step` steps when it is due (or `force`: the job was told to stop);
        records the training stall it caused."""
        every = self.cfg.every
        due = every and not (step % every and step != self.run.cfg.train.steps)
        if not (due or force) or (force and self.saving_step == step):
            return
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time
        self._save(step, record)
        record["checkpoint_stall_s"] = time.perf_counter() - t0
        grace = float(os.environ.get(GRACE_ENV, "0") or 0)
        if grace and record["checkpoint_stall_s"] > grace / 2 and self.rank == 0:
            warn(
                f"saving step {step} took {record['checkpoint_stall_s']:.0f} s, more than half "
                f"the {grace:.0f} s the scheduler allows between its stop signal and the kill: "
                "a preempted job may lose that save. Fix: --checkpoint.async=true, a faster "
                f"checkpoint.dir, or a longer grace ({GRACE_ENV}, Slurm --signal, the pod's "
                "terminationGracePeriodSeconds)."
            )

    def _save(self, step: int, record: dict) -> None:
        locals_ = local_state(self.run)
        held = self.channel.all_gather(
            ([lo.piece for lo in locals_], adam_step(self.run.optimizer))
        )
        owner = assign_writers([h[0] for h in held])
        mine: dict[io.Piece, torch.Tensor] = {}
        names: set[str] = set()
        for local in locals_:
            if owner[local.piece] == self.rank:
                name = io.file_key(local.piece)
                if name in names:
                    raise ValueError(f"two slices named {name} on one rank")
                names.add(name)
                mine[local.piece] = self._snapshot(local)
        dev.synchronize(self.run.info)  # the device-to-host copies are complete
        index = None
        if self.rank == 0:
            index = build_index(self.run, step, owner, max(h[1] for h in held))
            index["record"] = dict(record)  # logged after the save; restored if it never was
            index[lineage.HISTORY] = self.history
            if self.cfg.format == "dcp":
                index = dcp_format.manifest(index)
        self.saving_step = step
        if self.cfg.async_:
            # a daemon: a rank failing meanwhile must still exit (its save stays a .tmp)
            self._thread = threading.Thread(
                target=self._write_guarded, args=(step, mine, index), daemon=True
            )
            self._thread.start()
        else:
            self._write(step, mine, index)

    def _snapshot(self, local: Local) -> torch.Tensor:
        src = local.values()
        buf = self._host.get(io.file_key(local.piece))
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.device.type == "cuda")
            self._host[io.file_key(local.piece)] = buf
        buf.copy_(src, non_blocking=True)
        return buf

    def _write(self, step: int, tensors: dict[io.Piece, torch.Tensor], index: dict | None) -> None:
        """Write this rank's slices, then (rank 0) commit and prune; every rank stops alike on
        any rank's failure (checkpoint/saving.py holds the steps)."""
        tmp = io.step_dir(self.root, step).with_suffix(".tmp")
        made = None
        if self.rank == 0:  # one fresh directory, made by one rank: never a planted link
            made = attempt(lambda: lineage.make_tmp(self.root, step), f"creating {tmp}")
        raise_failed(self.root, step, self.channel.all_gather(made))
        # a full or failing disk on any rank: every rank stops with one message
        world, fmt = self.run.topo.world, self.cfg.format
        info = attempt(
            lambda: write_files(tmp, tensors, self.rank, self.channel, world, fmt),
            f"writing {tmp}",
        )
        infos = self.channel.all_gather(info)
        raise_failed(self.root, step, infos)
        failed = None
        if index is not None:
            index["files"] = {name: i for files in infos for name, i in files.items()}
            failed = attempt(
                lambda: commit(self.root, tmp, step, index, self._good), f"committing {tmp}"
            )
        # no rank moves on before the checkpoint is in place
        raise_failed(self.root, step, self.channel.all_gather(failed))
        if index is not None:
            prune(self.root, self.history, step, self.cfg.keep, self._good)

    def _write_guarded(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as exc:  # re-raised in the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; re-raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            if isinstance(exc, CheckpointError):  # already says which step and what is kept
                raise exc
            raise CheckpointError(
                f"saving the checkpoint of step {self.saving_step} failed: {exc}"
            ) from exc

    def close(self) -> None:
        self.wait()
