"""The default job, as `make train` runs it: `shardwise train` with no arguments, timed.

The foundation promises it finishes in under 3 minutes on a 2-core CPU machine, printing its
plan and progress. The test suite runs a 20-step version of the same command (tests/
test_default_job.py); this script runs all 200 steps and checks the time and the loss.

    .venv/bin/python benchmarks/default_job.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_smoke, command_line, commit, load

LIMIT_S = 180.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke(parser)
    smoke = parser.parse_args().smoke
    steps = ["--train.steps=2", "--train.eval_every=0"] if smoke else []
    shardwise = shutil.which("shardwise") or str(Path(sys.executable).parent / "shardwise")
    print(f"shardwise commit {commit()}")
    print(f"$ {command_line()}")
    print(f"load average at the start: {load()} (2 cores)")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        proc = subprocess.run(
            [shardwise, "train", *steps],
            cwd=tmp,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            capture_output=True,
            text=True,
        )
        elapsed = time.monotonic() - start
        if proc.returncode != 0:
            print(proc.stderr[-3000:])
            return 1
        records = [json.loads(line) for line in (Path(tmp) / "runs/default/metrics.jsonl").open()]
    plan = next(line for line in proc.stdout.splitlines() if line.startswith("shardwise: "))
    first, last = records[0], records[-1]
    print(f"plan: {plan}")
    print(f"steps: {len(records)}; loss {first['loss']:.4f} -> {last['loss']:.4f}")
    print(f"held-out loss at the end: {last.get('eval_loss')}")
    print(f"wall time, start-up included: {elapsed:.1f} s (limit {LIMIT_S:.0f} s)")
    print(f"load average at the end: {load()}")
    if smoke:
        return 0 if len(records) == 2 else 1
    ok = len(records) == 200 and elapsed < LIMIT_S and last["loss"] < first["loss"] - 2.0
    print("OK" if ok else "FAILED: not 200 steps, too slow, or the loss did not fall by 2")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
