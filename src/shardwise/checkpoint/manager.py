"""Saving a run and resuming it, in any layout: `Checkpointer` is what `fit()` calls.

Data order and initialisation depend only on the seed and the global sample index
(DESIGN.md), and the index stores the step, the loss scaler and AdamW's step count, so a
resumed run continues as if it had never stopped — bitwise in the same layout. A save is
synchronous, or (`checkpoint.async`) a host snapshot written by a background thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch

from shardwise.checkpoint import io as io
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


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _restart() -> str:
    """How many times torch elastic has restarted this job's ranks ("0": never)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


class Checkpointer:
    """Resumes at the start of `fit()` and saves every `checkpoint.every` steps (and after the
    last one). With `checkpoint.async` the save only snapshots this rank's slices to host
    memory; a background thread writes them and commits while training goes on."""

    def __init__(self, run) -> None:
        self.run, self.cfg = run, run.cfg.checkpoint
        self.root = Path(self.cfg.dir or Path(run.cfg.run.dir) / "checkpoints")
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

    # -- resume ---------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the checkpoint `checkpoint.resume` names; returns the step to continue from."""
        mode = self.cfg.resume
        if mode == "none":
            if self.cfg.every and io.list_complete(self.root):
                step = io.list_complete(self.root)[0][0]
                raise CheckpointError(
                    f"checkpoint.dir {self.root} already holds checkpoints (newest: step "
                    f"{step}) and checkpoint.resume=none would mix two runs there. Fix: "
                    "--checkpoint.resume=auto to continue that run, or another --checkpoint.dir."
                )
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
        else:
            path = self._explicit(Path(mode))
        return self._load(path)

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
                _warn(f"removing {left}: an unfinished save of this run (its shards only)")
                io.remove(left)
            for left in kept:
                _warn(
                    f"keeping {left}: it looks like an unfinished checkpoint but holds files a "
                    "save does not write, or lost its index.json; it is not loaded and not "
                    "deleted (remove it yourself if it is not needed)"
                )
        self.channel.all_gather(None)  # everyone lists the directory after the clean-up
        bad = []
        for _, path in io.list_complete(self.root):
            problems = self._problems(path)
            if not problems:
                return path
            bad.append(f"\n  {path.name}: " + "; ".join(problems))
            if self.rank == 0:
                _warn(f"skipping checkpoint {path}: " + "; ".join(problems))
        if bad:  # starting over would silently throw the run's progress away
            raise CheckpointError(
                f"checkpoint.dir {self.root} holds {len(bad)} checkpoint(s) and none is valid:"
                f"{''.join(bad)}\nNothing was changed. Fix: restore a checkpoint, name one with "
                "--checkpoint.resume=PATH, or start over with --checkpoint.resume=none and "
                "another --checkpoint.dir."
            )
        return None

    def _explicit(self, path: Path) -> Path:
        if not (path / io.INDEX).is_file() and (path / io.LATEST).is_file():
            path = path / (path / io.LATEST).read_text().strip()  # a checkpoint.dir
        problems = self._problems(path)
        if problems:
            raise CheckpointError(
                f"checkpoint.resume={path} is not a valid checkpoint: {'; '.join(problems)}. "
                "Fix: name a checkpoint directory (step-NNNNNNNN) or use "
                "--checkpoint.resume=auto to take the newest valid one."
            )
        return path

    def _load(self, path: Path) -> int:
        index = io.read_index(path)
        data, t = index["loop"]["data"], self.run.cfg.train
        if (data["global_batch"], data["seed"]) != (t.global_batch, t.seed):
            raise CheckpointError(
                f"checkpoint {path} was saved with train.global_batch={data['global_batch']} "
                f"and train.seed={data['seed']}; this run has {t.global_batch} and {t.seed}, "
                "which would change the data order. Fix: --train.global_batch="
                f"{data['global_batch']} --train.seed={data['seed']}."
            )
        note = self.run.resume_note = load_state(self.run, path, index, self.channel)
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
            _warn(
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
        mine = {}
        for local in locals_:
            if owner[local.piece] == self.rank:
                name = io.file_key(local.piece)
                if name in mine:
                    raise ValueError(f"two slices named {name} on one rank")
                mine[name] = self._snapshot(local)
        dev.synchronize(self.run.info)  # the device-to-host copies are complete
        index = None
        if self.rank == 0:
            index = build_index(self.run, step, owner, max(h[1] for h in held))
            index["record"] = dict(record)  # logged after the save; restored if it never was
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

    def _write(self, step: int, tensors: dict[str, torch.Tensor], index: dict | None) -> None:
        tmp = io.step_dir(self.root, step).with_suffix(".tmp")
        info: dict | str | None = None
        try:  # a full or failing disk on any rank: every rank stops with one message
            tmp.mkdir(parents=True, exist_ok=True)
            info = io.write_shard(tmp / io.shard_name(self.rank), tensors) if tensors else None
        except OSError as exc:
            info = f"rank {self.rank} writing {tmp}: {exc.strerror or exc}"
        infos = self.channel.all_gather(info)
        self._raise_failed(step, infos)
        failed = None
        if index is not None:
            index["files"] = {io.shard_name(r): i for r, i in enumerate(infos) if i is not None}
            try:
                io.commit(self.root, tmp, step, index, self.cfg.keep)
            except OSError as exc:
                failed = f"rank 0 committing {tmp}: {exc.strerror or exc}"
        # no rank moves on before the checkpoint is in place
        self._raise_failed(step, self.channel.all_gather(failed))

    def _raise_failed(self, step: int, reports: list) -> None:
        errors = [r for r in reports if isinstance(r, str)]
        if not errors:
            return
        kept = io.latest(self.root)
        raise CheckpointError(
            f"saving step {step} failed ({'; '.join(errors)}); "
            + (f"the last complete checkpoint, {kept}, is kept" if kept else "no checkpoint yet")
            + ". Fix: free space in (or repair) checkpoint.dir, or point --checkpoint.dir "
            "elsewhere, and run again with --checkpoint.resume=auto."
        )

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
