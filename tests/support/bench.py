"""Import a script of benchmarks/ (a folder of scripts, not a package) from a test."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def bench_module(name: str):
    """The module `name` of benchmarks/, imported with that folder on the path."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
