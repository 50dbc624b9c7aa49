"""A new run in a used run.dir never truncates what an earlier run wrote:
metrics.jsonl and a different config.json are kept under the next free number, and it says so."""

from __future__ import annotations

import json

import pytest

from shardwise.launchers.harness import run_here
from support.compare import case

pytestmark = pytest.mark.slow


def test_a_second_fresh_run_rotates_the_first_runs_files(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_here(case("--train.steps=2"), str(run_dir))
    first = (run_dir / "metrics.jsonl").read_bytes()
    first_config = (run_dir / "config.json").read_bytes()
    run_here(case("--train.steps=3"), str(run_dir))  # no checkpoints: a fresh start
    err = capsys.readouterr().err
    assert (run_dir / "metrics.1.jsonl").read_bytes() == first
    assert (run_dir / "config.1.json").read_bytes() == first_config
    assert "metrics.jsonl held an earlier run's records: kept as metrics.1.jsonl" in err
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps == [1, 2, 3]
    run_here(case("--train.steps=3"), str(run_dir))  # the same config: config.json stays
    assert (run_dir / "metrics.2.jsonl").is_file() and not (run_dir / "config.2.json").exists()
