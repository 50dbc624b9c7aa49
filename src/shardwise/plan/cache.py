"""Where the planner keeps what it measured on this machine, and how it measures: the cache
file, the key a measurement is valid for, and one intra-op thread as ranks run
(device.set_cpu_threads). Used by the calibration (calibrate.py) and the kernel timings
(kernels.py)."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

import torch

_VERSION = 11  # 11: gloo_sync floored at the idle call latency (calibrate._gloo)


def cache_file(name: str) -> Path:
    """`name` in `$SHARDWISE_CACHE` (default ~/.cache/shardwise): measurements kept per machine."""
    root = os.environ.get("SHARDWISE_CACHE", "") or os.path.expanduser("~/.cache/shardwise")
    return Path(root) / name


def machine_key() -> str:
    """What a measurement depends on: this version of it, the host, its cores, torch."""
    return f"v{_VERSION}|{platform.node()}|{os.cpu_count()}|{torch.__version__}"


@contextlib.contextmanager
def one_thread():
    """Measure as a rank runs: one intra-op thread (device.set_cpu_threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
