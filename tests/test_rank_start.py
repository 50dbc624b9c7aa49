"""Local ranks fork from a forkserver started for their launch (launchers/rank_start.py).
A forkserver's children inherit the server's environment from when it started, so a server
left by an earlier launch or by the harness would hand the ranks stale variables: each launch
starts its own, and its ranks see the launching process's environment as it is at the launch,
without the variable that marks the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardwise.launchers.rank_start import SERVER_ENV

pytestmark = pytest.mark.slow

# a process that has a forkserver running already (started while the variable said
# "earlier"), then launches a 2-rank job the way `shardwise train --nproc 2` does
SCRIPT = """
import os, sys
from multiprocessing import forkserver
os.environ["SHARDWISE_TEST_MARK"] = "earlier"
forkserver.ensure_running()
os.environ["SHARDWISE_TEST_MARK"] = "at the launch"
from support.faultjob import main
sys.exit(main(sys.argv[1:]))
"""


def test_ranks_see_the_environment_of_their_launch_not_an_earlier_servers(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--model.n_layers=1", "--data.seq_len=16", "--train.global_batch=4"]
    args += ["--train.steps=1", "--log.progress=off", "--run.device=cpu", f"--run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-c", SCRIPT, "support.hooks:record_environment", "2", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((run_dir / f"environment-rank{r}.json").read_text()) for r in (0, 1)]
    assert [e["SHARDWISE_TEST_MARK"] for e in seen] == ["at the launch"] * 2
    assert [e["RANK"] for e in seen] == ["0", "1"]  # torch elastic's own variables still set
    assert not any(SERVER_ENV in e for e in seen)
