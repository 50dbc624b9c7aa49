"""A real labelled text set without downloads: the docstrings of Python's own standard library,
each labelled by the top-level package it documents (asyncio, email, logging, ...).

`build(out)` writes one JSON line per docstring, `{"text": ..., "label": package}`, at most
`per_label` per package (the first in sorted file order, so every machine with the same
Python writes the same file). Read with `ast` (nothing is imported). Used by the
classification tests and benchmarks/minilm_classify.py.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path

PACKAGES = ("asyncio", "email", "logging", "xml", "unittest", "http", "multiprocessing")


def docstrings(package: Path, min_chars: int = 40):
    """Docstrings of the modules, classes and functions under `package` (tests excluded)."""
    for path in sorted(package.rglob("*.py")):
        if "test" in path.relative_to(package).parts[:-1]:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    yield " ".join(doc.split())


def build(out: str | Path, per_label: int = 120, packages: tuple[str, ...] = PACKAGES) -> Path:
    """Write the labelled rows to `out` (.jsonl); returns its path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for name in packages:
        if (root / name).is_dir():
            seen = list(dict.fromkeys(docstrings(root / name)))[:per_label]
            rows += [{"text": text, "label": name} for text in seen]
    out = Path(out)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
