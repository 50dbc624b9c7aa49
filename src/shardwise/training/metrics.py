"""Per-step records: `run.dir/metrics.jsonl` (the contract in docs/design.md), TensorBoard scalars,
W&B and MLflow (trackers.py), one log line per logged step and a progress bar on a terminal.
Only rank 0 writes."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.models import count_params
from shardwise.models.moe import inactive_params
from shardwise.training.nonfinite import describe
from shardwise.training.trackers import Trackers

LABELS = "labels.json"
METRICS = "metrics.jsonl"
TB = "tb"  # TensorBoard's event files


def flops_per_token(model: nn.Module, derived) -> float:
    """Training FLOPs per token, 6N + 12·L·h·s (PaLM, Chowdhery et al. 2022, appendix B), with
    N the non-embedding parameters (the head matmul counts; a lookup is not a matmul) and h
    the attention's width, n_heads · head_dim (the model's width unless model.head_dim).
    Zero for image models, whose FLOPs are not proportional to a token count."""
    spec = derived.spec
    if not derived.family.flops_per_token:
        return 0.0  # (a user's module: no formula knows what its parameters do per token)
    n = count_params(model, exclude_embedding=True)  # a tied head stays counted
    n -= inactive_params(model)  # MoE: the experts a token is not routed to do no work
    return 6.0 * n + 12.0 * spec.n_layers * spec.q_dim * derived.tokens_per_sample


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def format_line(r: dict, total_steps: int, unit: str = "tok") -> str:
    """The step's log line; `unit` is what a sample counts in (tokens, or rows: a
    classifier's sample is one row, one label)."""
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    parts = [
        f"step {r['step']}/{total_steps}",
        f"loss {r['loss']:.4f}",
        f"lr {r['lr']:.2e}",
        f"{1000 * r['step_time_s']:.0f} ms",
        f"{r['tokens_per_s']:,.0f} {unit}/s",
        f"mfu {mfu}",
        f"mem {human_bytes(r['mem_bytes']['total'])}",
    ]
    if "eval_loss" in r:
        parts.append(f"eval {r['eval_loss']:.4f}")
    if "eval_accuracy" in r:
        parts.append(f"acc {100 * r['eval_accuracy']:.1f}%")
    if "checkpoint_stall_s" in r:
        parts.append(f"saved (stall {1000 * r['checkpoint_stall_s']:.0f} ms)")
    if r.get("skipped"):
        why = describe(r["nonfinite"]) if r.get("nonfinite") else "non-finite values"
        scale = f", loss scale -> {r['loss_scale'] / 2:g}" if r["loss_scale"] != 1 else ""
        parts.append(f"SKIPPED ({why}{scale})")
    return " | ".join(parts)


def done_line(cfg, step: int, metrics: Path, saved: str | None) -> str:
    """A finished run's last line: what it wrote where."""
    tb = f", tensorboard {Path(cfg.run.dir) / TB}" if "tensorboard" in cfg.log.trackers() else ""
    kept = (
        f"checkpoint {saved}"
        if saved
        else "no checkpoint saved: the final state is not kept (checkpoint.every=0). Fix: "
        "--checkpoint.every=N to keep it"
    )
    return (
        f"shardwise: done at step {step}/{cfg.train.steps}: run dir {cfg.run.dir}, metrics "
        f"{metrics}{tb}, {kept}"
    )


def _before(line: str, step: int) -> bool:
    """A complete record of a step <= `step` (a killed rank 0 may leave half a line)."""
    try:
        return line.endswith("\n") and json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):
        return False


def _rotate(path: Path) -> Path:
    """Move `path` (metrics.jsonl, config.json, tb/) to the first free `name.N.suffix` and say
    so: a new run in a used run.dir never truncates what an earlier one wrote."""
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    os.replace(path, kept)
    print(
        f"shardwise: {path} held an earlier run's records: kept as {kept.name}",
        file=sys.stderr,
        flush=True,
    )
    return kept


@contextlib.contextmanager
def _writing(path: Path, run_dir: Path):
    """A failed write to run.dir (full, read-only) as one message with the path and the fix."""
    try:
        yield
    except OSError as exc:
        raise ShardwiseError(
            f"writing {path} failed ({exc.strerror or exc}). Fix: free space in (or make "
            f"writable) {run_dir}, or point --run.dir elsewhere, and run the same command "
            "again (it resumes from the newest checkpoint, if any)."
        ) from None


def _kept_records(path: Path, start_step: int, saved: dict | None) -> str:
    """metrics.jsonl of a resumed run: the complete records up to `start_step` (later ones are
    about to be redone), plus the checkpoint's record of that step if it was never logged."""
    text = path.read_text()
    if text and not text.endswith("\n"):  # a write cut short (a full disk, a kill)
        print(f"shardwise: {path}: dropped an incomplete last line", file=sys.stderr, flush=True)
    kept = [line for line in text.splitlines(True) if _before(line, start_step)]
    logged = {json.loads(line)["step"] for line in kept}
    if saved is not None and saved["step"] == start_step and start_step not in logged:
        kept.append(json.dumps(saved) + "\n")
    return "".join(kept)


class MetricsLogger:
    """Rank 0's records of a run: metrics.jsonl, TensorBoard scalars, log lines, progress."""

    def __init__(self, run, start_step: int = 0, saved: dict | None = None) -> None:
        """`start_step` > 0 continues a resumed run: records after it (written before a
        failure, and about to be redone) are dropped, earlier ones kept. `saved` is the
        record the checkpoint stored for `start_step`: written when the failure came between
        the save and its log line."""
        self.enabled = run.topo.rank == 0
        self.cfg = run.cfg
        self.total = run.cfg.train.steps
        self.path = Path(run.cfg.run.dir) / METRICS
        self.unit = "rows" if run.derived.tokens_per_sample == 1 else "tok"
        if not self.enabled:
            return
        out = self.path.parent
        with _writing(out, out):
            self._write_run_files(run, out)
        path = self.path
        with _writing(path, out):
            if start_step and path.is_file():  # replaced atomically: a kill here loses nothing
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(_kept_records(path, start_step, saved))
                os.replace(tmp, path)
            else:
                if path.is_file() and path.stat().st_size:  # a previous run's history: kept
                    _rotate(path)
                path.write_bytes(b"")
            if not start_step and (out / TB).is_dir() and any((out / TB).iterdir()):
                _rotate(out / TB)  # its curves with its metrics: never stacked on this run's
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.tb = None
        if "tensorboard" in run.cfg.log.trackers():
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops a previous attempt's events from the resumed step on
            self.tb = SummaryWriter(
                str(out / TB), purge_step=start_step + 1 if start_step else None
            )
        self.trackers = Trackers(run.cfg, out, start_step)  # W&B, MLflow
        self._start_progress(run.cfg.log.progress)

    def _write_run_files(self, run, out: Path) -> None:
        """config.json (an earlier, different one kept) and a classifier's labels.json."""
        out.mkdir(parents=True, exist_ok=True)
        config = json.dumps(run.cfg.to_dict(), indent=2)
        if (out / "config.json").is_file() and (out / "config.json").read_text() != config:
            _rotate(out / "config.json")  # another config's record is kept, not overwritten
        (out / "config.json").write_text(config)
        if run.derived.spec.labels:  # a classifier's label names, in id order (export reads them)
            names = {
                "label_field": run.cfg.data.label_field,
                "labels": list(run.derived.spec.labels),
            }
            (out / LABELS).write_text(json.dumps(names, indent=1))

    def _start_progress(self, mode: str) -> None:
        self.progress = None
        if mode == "on" or (mode == "auto" and sys.stdout.isatty()):
            from rich.progress import BarColumn, Progress, TimeRemainingColumn

            self.progress = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                "{task.completed}/{task.total}",
                TimeRemainingColumn(),
            )
            self.task = self.progress.add_task("training", total=self.total)
            self.progress.start()

    def _append(self, line: str) -> None:
        """Append one record whole or not at all: a write cut short (a full disk) is taken
        back, so metrics.jsonl never ends in half a line that later readers choke on."""
        data = memoryview(line.encode())
        at = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, at)  # shrinking needs no free space
            raise

    def log(self, r: dict) -> None:
        if not self.enabled:
            return
        with _writing(self.path, self.path.parent):
            self._append(json.dumps(r) + "\n")
        if self.tb is not None:
            with _writing(self.path.parent / TB, self.path.parent):  # (its thread's error)
                self._scalars(r)
        self.trackers.log(r)
        if r["step"] % self.cfg.log.every == 0 or r["step"] in (1, self.total) or r["skipped"]:
            line = format_line(r, self.total, self.unit)
            if self.progress is not None:
                self.progress.console.print(line)
            else:
                print(line, flush=True)
        if self.progress is not None:
            self.progress.update(self.task, completed=r["step"])

    def _scalars(self, r: dict) -> None:
        for key in (
            "loss",
            "grad_norm",
            "lr",
            "tokens_per_s",
            "step_time_s",
            "eval_loss",
            "eval_accuracy",
        ):
            if r.get(key) is not None:
                self.tb.add_scalar(f"train/{key}", r[key], r["step"])
        self.tb.add_scalar("memory/total_bytes", r["mem_bytes"]["total"], r["step"])

    def close_after_error(self) -> None:
        """On an error ending the run: this rank's TensorBoard events written out (its writer
        buffers them; a process ending without closing it may lose them). The trackers record
        the failure through their own exit hooks; `close` is not called after this."""
        if self.enabled and self.tb is not None:
            with contextlib.suppress(OSError):  # (a full disk: the error ending the run is
                self.tb.close()  # the one said)
            self.tb = None

    def close(self) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.stop()
        os.close(self.fd)
        self.trackers.close()
        if self.tb is not None:
            with _writing(self.path.parent / TB, self.path.parent):
                self.tb.close()
