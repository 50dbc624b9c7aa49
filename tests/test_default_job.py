"""`shardwise train` with no arguments runs the default job: the same command with only the
step count shortened (the whole 200-step job and its 3-minute bound are timed by
benchmarks/default_job.py, recorded in benchmarks/RESULTS.md)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHARDWISE = shutil.which("shardwise") or str(Path(sys.executable).parent / "shardwise")


@pytest.mark.slow
def test_default_job_starts_prints_its_plan_and_trains(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [SHARDWISE, "train", "--train.steps=20"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shardwise: tiny" in proc.stdout and "dp=2" in proc.stdout  # the plan is printed
    assert "step 20/20" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "runs/default/metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert "eval_loss" in records[-1]
