"""The job's TCPStores: rank 0's store bound to one address, and a free loopback port.

torch's TCPStore listens on every interface; these hand it a socket already bound to the
address the job names (loopback on one machine), as docs/checkpoints.md says.
"""

from __future__ import annotations

import errno
import socket
import time

import torch.distributed as dist

# Set by shardwise's launchers for their ranks: a rank store of their own (when the agent's
# is not shared with them) listens on MASTER_ADDR only (training/runtime.py)
BIND_ENV = "SHARDWISE_STORE_ON_MASTER_ADDR"


def rank_store(timeout_s: float, wait_for_all: bool = False) -> dist.TCPStore:
    """The job's store from the env:// variables, rank 0 hosting it on MASTER_ADDR only (with
    `wait_for_all`, once every rank of WORLD_SIZE has joined, or raising after `timeout_s`)."""
    import datetime
    import os

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ["RANK"] == "0":
        world = int(os.environ["WORLD_SIZE"]) if wait_for_all else None
        return listening_store(host, port, timeout_s, world)
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def listening_store(
    host: str, port: int, timeout_s: float, world: int | None = None
) -> dist.TCPStore:
    """A TCPStore server listening on `host`'s address only: TCPStore itself listens on every
    interface, so the socket is bound here and handed over (port 0: any free one). With
    `world`, it returns once `world - 1` clients have joined (or raises after `timeout_s`)."""
    import datetime

    sock = _bound(host, port, timeout_s)
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        world_size=world,
        is_master=True,
        multi_tenant=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=world is not None,
        master_listen_fd=sock.detach(),
    )


def _bound(host: str, port: int, timeout_s: float) -> socket.socket:
    """A socket listening on host:port. A port its clients already try to reach can be taken
    for a moment: a client on the same host whose ephemeral source port happens to be the
    port connects to itself (TCP's simultaneous open) until it gives up; so a busy port is
    tried again for up to `timeout_s` (at most 30 s) before it is an error."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    deadline = time.monotonic() + min(timeout_s, 30.0)
    while True:
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(1024)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE or not port or time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def free_port() -> int:
    """A free TCP port on loopback for a rendezvous store that stays on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
