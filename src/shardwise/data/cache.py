"""Encoded-record caches (classification rows, instruction and chat records): built once per
content key under a file lock, every file written to a temporary name and renamed, meta.json
last as the "complete" marker, so concurrent ranks build once and never read halves."""

from __future__ import annotations

import fcntl
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np


def read_meta(root: Path) -> dict | None:
    """The cache's meta.json at `root`, or None while it is missing or unreadable (not built,
    or being built)."""
    try:
        return json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def damage(root: Path, meta: dict) -> str | None:
    """Which file of the cache at `root` differs in size from what meta.json recorded when it
    was built (a copy cut short, a file deleted), or None. Caches built before sizes were
    recorded are taken as they are."""
    for name, want in meta.get("sizes", {}).items():
        path = root / name
        size = path.stat().st_size if path.is_file() else None
        if size != want:
            held = "is missing" if size is None else f"holds {size:,} bytes"
            return f"{name} {held}, its meta.json says {want:,}"
    return None


def build_once(root: Path, build: Callable[[Path], dict]) -> dict:
    """The cache's meta.json, running `build(root)` (which returns it) if it is missing or a
    file of it is damaged (rebuilt, saying so)."""
    meta = read_meta(root)
    if meta is not None:
        problem = damage(root, meta)
        if problem is None:
            return meta
        print(f"shardwise: the cache {root} is damaged ({problem}): rebuilding it", file=sys.stderr)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        meta = read_meta(root)  # another process may have (re)built it while we waited
        if meta is None or damage(root, meta):
            meta = build(root)
            meta["sizes"] = {
                f.name: f.stat().st_size for f in sorted(root.glob("*.npy")) if f.is_file()
            }
            tmp = root / "meta.json.tmp"
            tmp.write_text(json.dumps(meta, indent=1))
            tmp.replace(root / "meta.json")
    return meta


def save_array(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, array)
    tmp.replace(path)


def key_of(ident: dict) -> str:
    """A cache directory's name suffix: a stable hash of everything its contents depend on."""
    return hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=8).hexdigest()
