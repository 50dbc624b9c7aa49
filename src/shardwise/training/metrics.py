"""Per-step records: `run.dir/metrics.jsonl` (the contract in DESIGN.md), TensorBoard scalars,
one log line per logged step and a progress bar on a terminal. Only rank 0 writes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from torch import nn

from shardwise.models import count_params
from shardwise.training.nonfinite import describe

LABELS = "labels.json"


def flops_per_token(model: nn.Module, derived) -> float:
    """Training FLOPs per token, 6N + 12·L·h·s (PaLM, Chowdhery et al. 2022, appendix B), with
    N the non-embedding parameters (the head matmul counts; a lookup is not a matmul).
    Zero for image models, whose FLOPs are not proportional to a token count."""
    spec = derived.spec
    if spec.arch.startswith("resnet") or spec.arch == "custom":
        return 0.0  # (a user's module: no formula knows what its parameters do per token)
    n = count_params(model, exclude_embedding=True)  # a tied head stays counted
    return 6.0 * n + 12.0 * spec.n_layers * spec.dim * derived.tokens_per_sample


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def format_line(r: dict, total_steps: int) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    parts = [
        f"step {r['step']}/{total_steps}",
        f"loss {r['loss']:.4f}",
        f"lr {r['lr']:.2e}",
        f"{1000 * r['step_time_s']:.0f} ms",
        f"{r['tokens_per_s']:,.0f} tok/s",
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


def _before(line: str, step: int) -> bool:
    """A complete record of a step <= `step` (a killed rank 0 may leave half a line)."""
    try:
        return line.endswith("\n") and json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):
        return False


def _rotate(path: Path) -> Path:
    """Move `path` (metrics.jsonl, config.json) to the first free `name.N.suffix` and say so:
    a new run in a used run.dir never truncates what an earlier one wrote."""
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


class MetricsLogger:
    def __init__(self, run, start_step: int = 0, saved: dict | None = None) -> None:
        """`start_step` > 0 continues a resumed run: records after it (written before a
        failure, and about to be redone) are dropped, earlier ones kept. `saved` is the
        record the checkpoint stored for `start_step`: written when the failure came between
        the save and its log line."""
        self.enabled = run.topo.rank == 0
        self.cfg = run.cfg
        self.total = run.cfg.train.steps
        if not self.enabled:
            return
        out = Path(run.cfg.run.dir)
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
        path = out / "metrics.jsonl"
        if start_step and path.is_file():  # replaced atomically: a kill here loses nothing
            kept = [line for line in path.read_text().splitlines(True) if _before(line, start_step)]
            logged = {json.loads(line)["step"] for line in kept}
            if saved is not None and saved["step"] == start_step and start_step not in logged:
                kept.append(json.dumps(saved) + "\n")
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
            self.file = path.open("a")
        else:
            if path.is_file() and path.stat().st_size:  # a previous run's history: kept
                _rotate(path)
            self.file = path.open("w")
        self.tb = None
        if run.cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops a previous attempt's events from the resumed step on
            self.tb = SummaryWriter(
                str(out / "tb"), purge_step=start_step + 1 if start_step else None
            )
        mode = run.cfg.log.progress
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

    def log(self, r: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(r) + "\n")
        self.file.flush()
        if self.tb is not None:
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
        if r["step"] % self.cfg.log.every == 0 or r["step"] in (1, self.total) or r["skipped"]:
            line = format_line(r, self.total)
            if self.progress is not None:
                self.progress.console.print(line)
            else:
                print(line, flush=True)
        if self.progress is not None:
            self.progress.update(self.task, completed=r["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()
        self.file.close()
