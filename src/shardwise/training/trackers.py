"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow (TensorBoard is written
by metrics.py, as before). Rank 0 feeds each one every numeric scalar of each metrics.jsonl
record under the same name (nested ones as `mem_bytes/total`) at the record's step, and the
resolved config as parameters.

A tracker is a convenience, metrics.jsonl is the record: a missing package, or a tracker that
raises, is one warning line naming the backend and the fix, and the run goes on without it.

On resume both continue the run they started (ids kept in run.dir/trackers.json); steps
redone after the checkpoint are logged again (MLflow keeps both values in the step's history;
W&B writes a new offline folder with the same run id, `wandb sync` merges them). A fresh run in
a used run.dir starts new tracker runs: earlier ones stay in their stores, never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import netrc
import os
import sys
import time
from pathlib import Path
from typing import Any

IDS = "trackers.json"  # each tracker's run id, for a resumed run to continue it
MLRUNS = "mlruns"  # MLflow's default local store, under run.dir
FIX = {
    "wandb": "pip install wandb, or drop wandb from log.backends",
    "mlflow": "pip install mlflow-skinny (or mlflow), or drop mlflow from log.backends",
}


def scalars(r: dict, prefix: str = "") -> dict[str, float]:
    """Every number of a metrics.jsonl record but its step, nested keys joined by '/'."""
    out: dict[str, float] = {}
    for key, value in r.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            out[name] = float(value)
    return out


def params(cfg) -> dict[str, str]:
    """The resolved config as flat `section.key` -> text parameters."""
    return {f"{s}.{k}": str(v) for s, fields in cfg.to_dict().items() for k, v in fields.items()}


def _warn(name: str, what: str) -> None:
    print(f"shardwise: warning: {name} {what}. Fix: {FIX[name]}", file=sys.stderr, flush=True)


def _logged_in() -> bool:
    """An API key in the environment or in ~/.netrc for the W&B host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class _Wandb:
    def __init__(self, cfg, out: Path, run_id: str | None) -> None:
        import wandb

        # offline (files under run.dir/wandb, `wandb sync` uploads them) unless the user chose
        mode = os.environ.get("WANDB_MODE") or ("online" if _logged_in() else "offline")
        self.run = wandb.init(
            project=cfg.log.project,
            name=out.name,
            dir=str(out),
            config=cfg.to_dict(),
            id=run_id,
            resume="allow" if run_id else None,
            mode=mode,
            settings=wandb.Settings(console="off"),  # our log lines stay ours
        )
        self.id = self.run.id

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, cfg, out: Path, run_id: str | None) -> None:
        from mlflow.tracking import MlflowClient

        # MLflow's client retries a server 7 times with a 120 s timeout each: minutes in which
        # the other ranks wait in a collective. A tracker that cannot answer fails fast.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        uri = cfg.log.mlflow_uri
        if not uri:  # MLflow 3 keeps the file store behind this switch (no database needed)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (out / MLRUNS).resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        if run_id:
            self.id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        exp = self.client.get_experiment_by_name(cfg.log.project)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.log.project)
        self.id = self.client.create_run(exp_id, run_name=out.name).info.run_id
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params(cfg).items()]
        for i in range(0, len(items), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(self.id, params=items[i : i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.id)


KINDS = {"wandb": (_Wandb, "wandb"), "mlflow": (_Mlflow, "mlflow")}


class Trackers:
    """The run's W&B/MLflow trackers on rank 0; each failure drops only its tracker."""

    def __init__(self, cfg, out: Path, start_step: int) -> None:
        self.live: dict[str, Any] = {}
        ids = {}
        if start_step and (out / IDS).is_file():
            try:
                ids = json.loads((out / IDS).read_text())
            except ValueError:
                ids = {}
        for name in cfg.log.trackers():
            if name not in KINDS:
                continue  # tensorboard: metrics.py
            kind, module = KINDS[name]
            try:
                __import__(module)
            except ImportError:
                _warn(name, "is in log.backends but not installed; the run goes on without it")
                continue
            tracker = self._call(name, lambda k=kind, n=name: k(cfg, out, ids.get(n)))
            if tracker is not None:
                self.live[name] = tracker
        if self.live:  # (a run.dir that cannot take it: resuming then starts new tracker runs)
            ids.update({name: t.id for name, t in self.live.items()})
            with contextlib.suppress(OSError):
                (out / IDS).write_text(json.dumps(ids))

    def _call(self, name: str, fn, step: int | None = None) -> Any:
        try:
            return fn()
        except Exception as exc:  # a tracker never stops the run: metrics.jsonl has it all
            where = f" at step {step}" if step is not None else ""
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            _warn(name, f"failed{where} ({why[:200]}); the run goes on without it")
            tracker = self.live.pop(name, None)
            if tracker is not None and step is not None:
                with contextlib.suppress(Exception):  # already reported once
                    tracker.close()

    def log(self, r: dict) -> None:
        values = scalars(r)
        for name, tracker in list(self.live.items()):
            self._call(name, lambda t=tracker: t.log(r["step"], values), r["step"])

    def close(self) -> None:
        for name, tracker in list(self.live.items()):
            self._call(name, tracker.close)
        self.live.clear()
