"""Two hosts on one machine for multi-node tests: two Linux network namespaces joined by a
veth pair with private addresses. Each "host" has its own interfaces, routes and loopback, so
a job spanning them really talks over a network link, and killing every process in one
namespace is a host going down. Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.231.0"  # private (RFC 1918) and only visible inside the two namespaces
ETC = Path("/etc/netns")


@dataclass(frozen=True)
class Host:
    netns: str
    addr: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=10
        ).stdout
        return [int(p) for p in out.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process in the namespace (the host dies); returns their pids."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids


def _etc(host: Host) -> None:
    """`ip netns exec` mounts /etc/netns/NAME/* over /etc: each host resolves its own name to
    its own address, and has no DNS server (the machine's is unreachable from the namespace;
    name lookups would wait for it to time out)."""
    etc = ETC / host.netns
    etc.mkdir(parents=True, exist_ok=True)
    name = socket.gethostname()
    (etc / "hosts").write_text(f"127.0.0.1 localhost\n{host.addr} {name}\n")
    (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


@contextlib.contextmanager
def two_hosts(tag: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Create the namespaces and the link; always remove them (and what runs in them)."""
    tag = tag or f"sw{os.getpid() % 100000}"
    hosts = (Host(f"{tag}a", f"{SUBNET}.1"), Host(f"{tag}b", f"{SUBNET}.2"))
    created: list[Host] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.netns)
            created.append(host)
            _etc(host)
        a, b = hosts
        _ip("link", "add", f"{tag}a0", "netns", a.netns, "type", "veth", "peer", "name",
            f"{tag}b0", "netns", b.netns)  # fmt: skip
        for host, dev in ((a, f"{tag}a0"), (b, f"{tag}b0")):
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", dev)
            _ip("-n", host.netns, "link", "set", dev, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host in created:
            host.kill_all()
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=10)
            shutil.rmtree(ETC / host.netns, ignore_errors=True)
