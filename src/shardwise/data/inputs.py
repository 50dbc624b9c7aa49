"""The documents of `shardwise data prepare`'s inputs, in order, with their identity.

An input is what `data.dataset` takes (a file, directory or glob of .txt/.jsonl/.json/.csv/
.parquet files, or `stdlib`), read by the same code (data/corpus.py), or a folder a Hugging
Face `datasets` object was saved to with `save_to_disk`. Document ids are the ones training
hashes to hold documents out, so one input splits exactly as `data.dataset` would split it;
with several inputs each id is prefixed by its input's position, so equal relative paths in
two inputs stay two documents.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.data.corpus import DataSpec, read_documents, resolve_source
from shardwise.errors import DataError


@dataclass
class Inputs:
    """Every document of the inputs, in order, and what identifies them."""

    docs: list[tuple[str, str]] = field(default_factory=list)  # (document id, text)
    skipped: list[str] = field(default_factory=list)  # rows without a text value
    identity: list = field(default_factory=list)  # (path, size, mtime_ns) per file read


def is_hf_saved(path: Path) -> bool:
    """A folder `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk`
    (dataset_dict.json) wrote."""
    return path.is_dir() and (
        (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    )


def read_inputs(inputs: list[str], text_field: str, exclude: tuple[str, ...]) -> Inputs:
    """The documents of every input in order; `exclude`: directories a scan leaves out (the
    output directory)."""
    if not inputs:
        raise DataError("no INPUT given. Fix: shardwise data prepare INPUT... --out DIR.")
    out = Inputs()
    for k, raw in enumerate(inputs):
        prefix = f"{k}:" if len(inputs) > 1 else ""
        before = len(out.docs)
        path = Path(os.path.expanduser(raw))
        if is_hf_saved(path):
            _read_hf(path, text_field, prefix, out)
        else:
            try:
                source = resolve_source(DataSpec(raw, text_field=text_field, exclude=exclude))
            except DataError as exc:  # its words are data.dataset's; here it is an INPUT
                raise DataError(str(exc).replace("data.dataset=", "INPUT ", 1)) from None
            out.identity += source.identity()
            for doc_id, text in read_documents(source, text_field, out.skipped):
                out.docs.append((prefix + doc_id, text))
        if len(out.docs) == before:
            raise DataError(
                f"INPUT {raw!r} holds no text (0 non-empty documents in its {text_field!r} "
                "field). Fix: drop it, or point it at non-empty files (--text-field names the "
                "column)."
            )
    return out


def _read_hf(path: Path, text_field: str, prefix: str, out: Inputs) -> None:
    """The rows of a `save_to_disk` folder (every split of a DatasetDict, in its order)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError... by case
        raise DataError(
            f"INPUT {str(path)!r} does not load with datasets.load_from_disk: "
            f"{type(exc).__name__}: {exc}. Fix: the folder save_to_disk wrote."
        ) from None
    parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    for split, ds in parts:
        if text_field not in ds.column_names:
            raise DataError(
                f"--text-field {text_field!r} is not a column of {str(path)!r}"
                f"{f' (split {split!r})' if split else ''}; its columns are {ds.column_names}. "
                "Fix: --text-field COLUMN naming the text."
            )
        for i, value in enumerate(ds.data.column(text_field).to_pylist()):
            if value is None:
                out.skipped.append(f"{path.name}/{split} row {i + 1}")
            elif not isinstance(value, str):
                raise DataError(
                    f"--text-field {text_field!r} holds a {type(value).__name__} in row {i} of "
                    f"{str(path)!r}, not text. Fix: --text-field naming a string column."
                )
            elif value:
                out.docs.append((f"{prefix}{split}#{i}", value))
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        st = f.stat()
        out.identity.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
