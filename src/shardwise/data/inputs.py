"""The documents of `shardwise data prepare`'s inputs, in order, with their identity.

An input is what `data.dataset` takes (a file, directory or glob of .txt/.jsonl/.json/.csv/
.parquet files, or `stdlib`), read by the same code (data/corpus.py), a folder a Hugging
Face `datasets` object was saved to with `save_to_disk`, or `hf:NAME[:OPTION=VALUE,...]`: what
`datasets.load_dataset(NAME, ..., streaming=True)` yields, row by row (`stream_spec`). Document
ids are the ones training
hashes to hold documents out, so one input splits exactly as `data.dataset` would split it;
with several inputs each id is prefixed by its input's position, so equal relative paths in
two inputs stay two documents.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
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
        if raw.startswith(STREAM):
            _read_stream(raw, text_field, prefix, out)
        elif is_hf_saved(path):
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
            _no_column(text_field, str(path), split, ds.column_names)
        values = ds.data.column(text_field).to_pylist()
        _take(values, text_field, str(path), f"{path.name}/{split}", f"{prefix}{split}", out)
    _stat(sorted(p for p in path.rglob("*") if p.is_file()), out)


def _no_column(text_field: str, where: str, split: str, columns: list) -> None:
    raise DataError(
        f"--text-field {text_field!r} is not a column of {where!r}"
        f"{f' (split {split!r})' if split else ''}; its columns are {columns}. "
        "Fix: --text-field COLUMN naming the text."
    )


def _take(
    values: Iterable, text_field: str, where: str, row_of: str, ids: str, out: Inputs
) -> None:
    """Each non-empty text value of `values` one document `{ids}#{i}`; a missing one skipped
    (counted against --max-bad-rows), anything else refused."""
    for i, value in enumerate(values):
        if value is None:
            out.skipped.append(f"{row_of} row {i + 1}")
        elif not isinstance(value, str):
            raise DataError(
                f"--text-field {text_field!r} holds a {type(value).__name__} in row {i} of "
                f"{where!r}, not text. Fix: --text-field naming a string column."
            )
        elif value:
            out.docs.append((f"{ids}#{i}", value))


def _stat(files: list[Path], out: Inputs) -> None:
    for f in files:
        st = f.stat()
        out.identity.append((str(f.resolve()), st.st_size, st.st_mtime_ns))


# -- hf:NAME: a `datasets` dataset read in streaming mode ---------------------------------------
STREAM = "hf:"
_OPTIONS = ("data_files", "split", "config", "data_dir")
_FORM = (
    "Fix: hf:NAME[:OPTION=VALUE,...] with OPTION one of data_files (a glob), split, config, "
    "data_dir, e.g. 'hf:json:data_files=corpus/*.jsonl'."
)


def stream_spec(raw: str) -> dict[str, str]:
    """`hf:NAME[:OPTION=VALUE,...]` as load_dataset's arguments: NAME (a packaged builder
    such as json, csv, parquet, text, or a dataset on the Hub), data_files (one glob, read in
    sorted order), split (default: every split, in the dataset's order), config, data_dir."""
    name, _, rest = raw[len(STREAM) :].partition(":")
    if not name.strip():
        raise DataError(f"INPUT {raw!r} names no dataset. {_FORM}")
    spec = {"path": name.strip()}
    for part in filter(None, rest.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in _OPTIONS or not value.strip():
            raise DataError(f"INPUT {raw!r}: {part!r} is not OPTION=VALUE. {_FORM}")
        spec["name" if key.strip() == "config" else key.strip()] = value.strip()
    return spec


def _read_stream(raw: str, text_field: str, prefix: str, out: Inputs) -> None:
    """The rows of `load_dataset(..., streaming=True)`, one at a time: no Arrow copy of the
    dataset is built; each row's text joins the documents."""
    import datasets

    spec = stream_spec(raw)
    files = []
    if "data_files" in spec:
        files = sorted(glob.glob(os.path.expanduser(spec["data_files"]), recursive=True))
        files = [f for f in files if os.path.isfile(f)]
        if not files:
            raise DataError(
                f"INPUT {raw!r}: data_files {spec['data_files']!r} matches no file. Fix: a glob "
                "of existing files (quoted, so the shell leaves it to shardwise)."
            )
        spec["data_files"] = files
    try:
        loaded = datasets.load_dataset(**spec, streaming=True)
        parts = loaded.items() if isinstance(loaded, datasets.IterableDatasetDict) else None
        for split, ds in parts or [(spec.get("split", ""), loaded)]:
            rows = iter(ds)
            first = next(rows, None)
            if first is not None and text_field not in first:
                _no_column(text_field, raw, split, list(first))
            values = (row.get(text_field) for row in _chain(first, rows))
            _take(values, text_field, raw, f"{raw}/{split}", f"{prefix}{split}", out)
    except DataError:
        raise
    except Exception as exc:  # datasets raises ConnectionError, ValueError, its own... by case
        raise DataError(
            f"INPUT {raw!r} does not stream with datasets.load_dataset: {type(exc).__name__}: "
            f"{exc}. Fix: a builder and data files that load (a Hub dataset needs the network)."
        ) from None
    # what a rerun must find unchanged: the request, and the local files it read
    out.identity.append((raw, 0, 0))
    _stat([Path(f) for f in files], out)


def _chain(first, rest) -> Iterable:
    if first is not None:
        yield first
        yield from rest
