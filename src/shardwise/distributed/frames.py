"""Which Python frames are torch's own. A call site that shardwise names (a host sync's in
profile/host_syncs.py, the line of a forward that read a fake tensor's value in job/fake.py) is
the innermost frame outside them: the user's code or the package's, never torch's internals."""

from __future__ import annotations

import os

import torch

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def in_torch(path: str) -> bool:
    """Whether the source file `path` is torch's own (under its installed package)."""
    return path.startswith(TORCH_DIR)
