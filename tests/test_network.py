"""What a run exposes on the network: a local run's server sockets listen on loopback only.

Read from the kernel (/proc/net/tcp and tcp6, matched to the job's processes), not from our
code; nothing is sent anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shardwise.testing.sockets import is_loopback, listening

SMALL = [
    "--model.name=tiny",
    "--model.n_layers=1",
    "--data.seq_len=32",
    "--train.steps=12",
    "--train.eval_batches=0",
    "--log.tensorboard=false",
]


def _listeners(run_dir, *extra) -> set[tuple[str, int]]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardwise.cli.main",
            "train",
            "--nproc",
            "2",
            *SMALL,
            f"--run.dir={run_dir}",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    seen: set[tuple[str, int]] = set()
    while proc.poll() is None:
        seen |= listening(proc.pid)
        time.sleep(0.1)
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    return seen


@pytest.mark.parametrize(
    "extra",
    [[], ["--max-restarts", "1", "--checkpoint.every=100"]],
    ids=["agent-store-shared", "a-store-per-attempt"],
)
def test_a_local_run_listens_on_loopback_only(tmp_path, extra):
    seen = _listeners(tmp_path / "run", *extra)
    # the rendezvous store and gloo's pairs at least (torch's own stores listen on '::')
    assert len(seen) >= 2, seen
    assert all(is_loopback(addr) for addr, _ in seen), sorted(seen)
