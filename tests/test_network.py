"""What a run exposes on the network: a local run's server sockets listen on loopback only.

Read from the kernel (/proc/net/tcp and tcp6, matched to the job's processes), not from our
code; nothing is sent anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from support.sockets import is_loopback, listening

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


def test_a_store_port_held_for_a_moment_is_tried_again():
    """Rank 0 binds MASTER_PORT after its peers may already be dialling it; a peer on the same
    host whose ephemeral source port is that port connects to itself and holds it until it
    gives up. The store's bind waits that out (bounded) instead of failing the job; a port
    held for good is still an error after the wait."""
    import errno
    import socket
    import threading

    from shardwise.distributed.store import _bound

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    threading.Timer(0.6, holder.close).start()
    t0 = time.monotonic()
    sock = _bound("127.0.0.1", port, timeout_s=10)
    assert sock.getsockname()[1] == port and time.monotonic() - t0 >= 0.5
    with pytest.raises(OSError) as busy:
        _bound("127.0.0.1", port, timeout_s=0.5)  # `sock` holds it now
    assert busy.value.errno == errno.EADDRINUSE
    sock.close()
