"""Experiment trackers (log.backends): real MLflow (its local file store) and real W&B (offline)
get every step's scalars of metrics.jsonl and the config; a missing package or a tracker that
fails mid-run is one warning and the run goes on; a resumed run continues its tracker runs;
an unknown backend is a ConfigError naming the valid ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.launchers.harness import run_here
from support.compare import SMALL

STEPS = 3
WARNING = "shardwise: warning:"


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No login, no telemetry, nothing written outside tmp_path (W&B reads ~/.netrc)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # restored to its state after the test
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # the tracker sets it for its own store
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def _run(run_dir: Path, *extra: str) -> list[dict]:
    case = {"overrides": [*SMALL, f"--train.steps={STEPS}", *extra]}
    result = run_here(case, str(run_dir))
    assert "error" not in result, result
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _mlflow(run_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    return client, run_id


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file: a 7-byte ':W&B' header, then LevelDB's log
    format (32 KiB blocks of chunks: crc32, length, type 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def _key(item) -> str:
    """A W&B item's key (wandb-core may send it as a one-part `nested_key`)."""
    return item.key or "/".join(item.nested_key)


def _wandb(run_dir: Path) -> tuple[dict[int, dict], dict]:
    """(step -> logged values, config) from the offline run's .wandb file."""
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {_key(i): json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num] = items
        elif kind in ("run", "config"):  # the config comes with the run, updates after it
            update = record.run.config.update if kind == "run" else record.config.update
            config.update({_key(i): json.loads(i.value_json) for i in update})
    return history, config


def test_mlflow_and_wandb_get_every_step_and_the_config(tmp_path: Path, capsys) -> None:
    pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (the dev extra has it)")
    pytest.importorskip("wandb", reason="wandb is not installed (the dev extra has it)")
    run_dir = tmp_path / "run"
    records = _run(run_dir, "--log.backends=wandb,mlflow")
    assert WARNING not in capsys.readouterr().err
    losses = {r["step"]: r["loss"] for r in records}
    assert sorted(losses) == list(range(1, STEPS + 1))

    client, run_id = _mlflow(run_dir)
    history = client.get_metric_history(run_id, "loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses, rel=1e-12)
    assert len(history) == STEPS
    total = client.get_metric_history(run_id, "mem_bytes/total")
    assert [m.value for m in total] == [r["mem_bytes"]["total"] for r in records]
    run = client.get_run(run_id)
    assert run.data.params["train.steps"] == str(STEPS)
    assert run.data.params["log.backends"] == "wandb,mlflow"
    assert run.info.status == "FINISHED" and run.info.run_name == "run"

    logged, config = _wandb(run_dir)
    assert {s: v["loss"] for s, v in logged.items()} == pytest.approx(losses, rel=1e-12)
    assert [logged[r["step"]]["grad_norm"] for r in records] == [r["grad_norm"] for r in records]
    assert config["train"]["steps"] == STEPS
    assert config["log"]["backends"] == "wandb,mlflow"


def test_a_missing_package_is_one_warning(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    records = _run(tmp_path / "run", "--log.backends=wandb")
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(WARNING)]
    assert len(warnings) == 1, warnings
    assert "wandb" in warnings[0] and "Fix: pip install wandb" in warnings[0]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))


def test_a_tracker_failing_mid_run_is_one_warning(tmp_path: Path, capsys, monkeypatch) -> None:
    pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (the dev extra has it)")
    from shardwise.training import trackers

    real = trackers._Mlflow.log

    def flaky(self, step: int, values: dict) -> None:
        if step >= 2:
            raise ConnectionError("tracking server went away")
        real(self, step, values)

    monkeypatch.setattr(trackers._Mlflow, "log", flaky)
    run_dir = tmp_path / "run"
    records = _run(run_dir, "--log.backends=mlflow")
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(WARNING)]
    assert len(warnings) == 1, warnings
    assert "mlflow failed at step 2" in warnings[0] and "went away" in warnings[0]
    assert "Fix:" in warnings[0]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    client, run_id = _mlflow(run_dir)
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1]


def test_a_resumed_run_continues_its_mlflow_run(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (the dev extra has it)")
    run_dir = tmp_path / "run"
    args = ["--log.backends=mlflow", "--checkpoint.every=2", f"--checkpoint.dir={tmp_path}/ck"]
    _run(run_dir, "--train.steps=2", *args)
    client, first = _mlflow(run_dir)
    records = _run(run_dir, "--train.steps=4", "--checkpoint.resume=auto", *args)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    client, run_id = _mlflow(run_dir)
    assert run_id == first
    history = client.get_metric_history(run_id, "loss")
    assert {m.step: m.value for m in history} == pytest.approx(
        {r["step"]: r["loss"] for r in records}, rel=1e-12
    )


def test_backends_parse_and_relate_to_log_tensorboard() -> None:
    log = load_config(None, ["--log.backends= WandB, mlflow,wandb,tensorboard"]).log
    assert log.backends == "wandb,mlflow,tensorboard"
    assert log.trackers() == ("wandb", "mlflow", "tensorboard")
    assert load_config(None, []).log.trackers() == ("tensorboard",)
    assert load_config(None, ["--log.tensorboard=false"]).log.trackers() == ()
    off = ["--log.backends=tensorboard,mlflow", "--log.tensorboard=false"]
    assert load_config(None, off).log.trackers() == ("mlflow",)
    assert load_config(None, ["--log.backends="]).log.trackers() == ()


def test_an_unknown_backend_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--log.backends=tensorboard,wandbb"])
    msg = str(err.value)
    assert "'wandbb'" in msg and "did you mean 'wandb'" in msg
    assert "tensorboard, wandb, mlflow" in msg


def test_an_mlflow_uri_without_mlflow_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--log.mlflow_uri=sqlite:///m.db"])
    assert "log.mlflow_uri='sqlite:///m.db' is set" in str(err.value)
    assert "--log.backends=tensorboard,mlflow" in str(err.value)
    uri = ["--log.mlflow_uri=sqlite:///m.db", "--log.backends=mlflow"]
    assert load_config(None, uri).log.mlflow_uri == "sqlite:///m.db"
