"""Which addresses a job's processes listen on, read from the kernel (/proc), not from our code.

`listening(root_pid)`: every TCP socket in LISTEN state held by `root_pid` or any of its
descendants, as (address, port), from /proc/net/tcp and /proc/net/tcp6 matched by inode to
the processes' open file descriptors. Nothing is sent anywhere (the network rule in
ENVIRONMENT.md: to show which addresses a run listens on, read /proc).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

LISTEN = "0A"


def descendants(root: int) -> set[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def _inodes(pids: set[int]) -> set[str]:
    found = set()
    for pid in pids:
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    found.add(target[8:-1])
        except OSError:  # the process ended meanwhile
            continue
    return found


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:  # little-endian per 32-bit word
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening(root: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of `root` and its descendants."""
    inodes = _inodes(descendants(root))
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == LISTEN and cols[9] in inodes:
                addr, port = cols[1].split(":")
                out.add((_address(addr), int(port, 16)))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
