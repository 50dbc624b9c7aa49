"""The documents of `shardwise data prepare`'s inputs, in order, with their identity.

Inputs are resolved (found, their files listed and identified) before any is read, and
their documents are then read as a stream, one file, Arrow batch or streamed row at a
time, as often as the prepare needs them: never the whole corpus at once.

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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from shardwise.data.corpus import DataSpec, Source, read_documents, resolve_source
from shardwise.data.files import excluded_dirs, inside
from shardwise.errors import DataError


@dataclass(frozen=True)
class Input:
    """One INPUT resolved (it exists, its files are found) but not read yet."""

    raw: str  # as given
    prefix: str  # of its document ids: "k:" with several inputs
    identity: list  # (path, size, mtime_ns) per file it reads
    source: Source | None = None  # files read as data.dataset reads them
    saved: Path | None = None  # a save_to_disk folder
    stream: dict | None = None  # load_dataset arguments of hf:NAME


def is_hf_saved(path: Path) -> bool:
    """A folder `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk`
    (dataset_dict.json) wrote."""
    return path.is_dir() and (
        (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    )


def resolve_inputs(inputs: list[str], text_field: str, exclude: tuple[str, ...]) -> list[Input]:
    """Every INPUT found and identified, none read; `exclude`: directories a scan leaves out
    (the output directory)."""
    if not inputs:
        raise DataError("no INPUT given. Fix: shardwise data prepare INPUT... --out DIR.")
    out = []
    for k, raw in enumerate(inputs):
        prefix = f"{k}:" if len(inputs) > 1 else ""
        path = Path(os.path.expanduser(raw))
        if raw.startswith(STREAM):
            spec = _stream_files(raw, stream_spec(raw), exclude)
            files = [Path(f) for f in spec.get("data_files", [])]
            # what a rerun must find unchanged: the request, and the local files it reads
            out.append(Input(raw, prefix, [(raw, 0, 0), *_stat(files)], stream=spec))
        elif is_hf_saved(path):
            files = sorted(p for p in path.rglob("*") if p.is_file())
            out.append(Input(raw, prefix, _stat(files), saved=path))
        else:
            try:
                source = resolve_source(DataSpec(raw, text_field=text_field, exclude=exclude))
            except DataError as exc:  # its words are data.dataset's; here it is an INPUT
                raise DataError(str(exc).replace("data.dataset=", "INPUT ", 1)) from None
            files = source.identity()
            if all(size == 0 for _, size, _ in files):  # known before any file is read
                _no_text(raw, text_field)
            out.append(Input(raw, prefix, files, source=source))
    return out


def documents(
    inputs: list[Input], text_field: str, skipped: list[str]
) -> Iterator[tuple[str, str]]:
    """(document id, text) of every input in order, read one file (or Arrow batch, or
    streamed row) at a time; rows without a text value go into `skipped`."""
    for one in inputs:
        n = 0
        if one.stream is not None:
            docs = _read_stream(one.raw, one.stream, text_field, one.prefix, skipped)
        elif one.saved is not None:
            docs = _read_hf(one.saved, text_field, one.prefix, skipped)
        else:
            read = read_documents(one.source, text_field, skipped)
            docs = ((one.prefix + doc_id, text) for doc_id, text in read)
        for doc in docs:
            n += 1
            yield doc
        if not n:
            _no_text(one.raw, text_field)


def _no_text(raw: str, text_field: str) -> None:
    raise DataError(
        f"INPUT {raw!r} holds no text (0 non-empty documents in its {text_field!r} field). "
        "Fix: drop it, or point it at non-empty files (--text-field names the column)."
    )


def _read_hf(
    path: Path, text_field: str, prefix: str, skipped: list[str]
) -> Iterator[tuple[str, str]]:
    """The rows of a `save_to_disk` folder (every split of a DatasetDict, in its order), one
    Arrow batch at a time."""
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
        column = ds.data.column(text_field)
        values = (v for batch in column.chunks for v in batch.to_pylist())
        where, row_of = str(path), f"{path.name}/{split}"
        yield from _take(values, text_field, where, row_of, f"{prefix}{split}", skipped)


def _no_column(text_field: str, where: str, split: str, columns: list) -> None:
    raise DataError(
        f"--text-field {text_field!r} is not a column of {where!r}"
        f"{f' (split {split!r})' if split else ''}; its columns are {columns}. "
        "Fix: --text-field COLUMN naming the text."
    )


def _take(
    values: Iterable, text_field: str, where: str, row_of: str, ids: str, skipped: list[str]
) -> Iterator[tuple[str, str]]:
    """Each non-empty text value of `values` one document `{ids}#{i}`; a missing one skipped
    (counted against --max-bad-rows), anything else refused."""
    for i, value in enumerate(values):
        if value is None:
            skipped.append(f"{row_of} row {i + 1}")
        elif not isinstance(value, str):
            raise DataError(
                f"--text-field {text_field!r} holds a {type(value).__name__} in row {i} of "
                f"{where!r}, not text. Fix: --text-field naming a string column."
            )
        elif value:
            yield f"{ids}#{i}", value


def _stat(files: list[Path]) -> list[tuple[str, int, int]]:
    out = []
    for f in files:
        st = f.stat()
        out.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    return out


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


def _stream_files(raw: str, spec: dict, exclude: tuple[str, ...]) -> dict:
    """`spec` with its data_files glob resolved to the sorted files it matches, less those in
    `exclude` (the output directory: its tokenizer.json would otherwise be a document)."""
    if "data_files" not in spec:
        return spec
    skip = excluded_dirs(exclude)
    files = sorted(glob.glob(os.path.expanduser(spec["data_files"]), recursive=True))
    files = [f for f in files if os.path.isfile(f) and not inside(Path(os.path.realpath(f)), skip)]
    if not files:
        raise DataError(
            f"INPUT {raw!r}: data_files {spec['data_files']!r} matches no file. Fix: a glob "
            "of existing files (quoted, so the shell leaves it to shardwise)."
        )
    return {**spec, "data_files": files}


def _read_stream(
    raw: str, spec: dict, text_field: str, prefix: str, skipped: list[str]
) -> Iterator[tuple[str, str]]:
    """The rows of `load_dataset(**spec, streaming=True)`, one at a time: no Arrow copy of
    the dataset is built; each row's text is a document."""
    import datasets

    try:
        loaded = datasets.load_dataset(**spec, streaming=True)
        parts = loaded.items() if isinstance(loaded, datasets.IterableDatasetDict) else None
        for split, ds in parts or [(spec.get("split", ""), loaded)]:
            rows = iter(ds)
            first = next(rows, None)
            if first is not None and text_field not in first:
                _no_column(text_field, raw, split, list(first))
            values = (row.get(text_field) for row in _chain(first, rows))
            yield from _take(values, text_field, raw, f"{raw}/{split}", f"{prefix}{split}", skipped)
    except DataError:
        raise
    except Exception as exc:  # datasets raises ConnectionError, ValueError, its own... by case
        raise DataError(
            f"INPUT {raw!r} does not stream with datasets.load_dataset: {type(exc).__name__}: "
            f"{exc}. Fix: a builder and data files that load (a Hub dataset needs the network)."
        ) from None


def _chain(first, rest) -> Iterable:
    if first is not None:
        yield first
        yield from rest
