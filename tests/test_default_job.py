"""`shardwise train` with no arguments runs the default job to completion in under 3 minutes."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SHARDWISE = shutil.which("shardwise") or str(Path(sys.executable).parent / "shardwise")


@pytest.mark.slow
def test_default_job_runs_to_completion(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.run(
        [SHARDWISE, "train"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shardwise: tiny" in proc.stdout and "dp=2" in proc.stdout  # the plan is printed
    assert "step 200/200" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "runs/default/metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, 201))
    assert records[-1]["loss"] < records[0]["loss"] - 2.0
    assert "eval_loss" in records[-1]
    assert elapsed < 180, f"default job took {elapsed:.0f} s"
