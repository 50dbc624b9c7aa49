"""One column of a json/parquet/csv file, read with `datasets` one Arrow batch at a time.

The file is converted to a memory-mapped Arrow file in a temporary directory, so only one
batch's values are Python objects at once; a file it cannot parse, or a column it lacks, is
refused with the file's name, the first bad line where there is one, and the fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from shardwise.data.files import first_bad_line
from shardwise.errors import DataError


def builder_of(suffix: str) -> str:
    """The `datasets` builder reading a file of this extension."""
    return {".parquet": "parquet", ".csv": "csv"}.get(suffix, "json")


def load_column(path: Path, builder: str, text_field: str, key: str = "data.text_field") -> list:
    """Load one json/parquet file with `datasets`, quietly, and return its text column."""
    return list(iter_column(path, builder, text_field, key))


def iter_column(
    path: Path, builder: str, text_field: str, key: str = "data.text_field"
) -> Iterator:
    """The values of one json/parquet/csv file's column, one Arrow batch at a time: the file
    is converted to a memory-mapped Arrow file, and only one batch's values are Python
    objects at once (a multi-GB JSON lines file is never held whole)."""
    import tempfile

    if _blank(path):  # no rows, as an empty .txt holds no document (datasets cannot parse it)
        return
    # The arrow copy is only needed while we read it; keep it out of ~/.cache/huggingface.
    with tempfile.TemporaryDirectory(prefix="shardwise-hf-") as tmp:
        column = _arrow_column(path, builder, text_field, key, tmp)
        for batch in column.chunks:
            try:
                values = batch.to_pylist()
            except Exception as exc:  # Arrow keeps bytes that are not UTF-8 until this
                raise _unreadable(path, builder, exc) from exc
            yield from values


def _blank(path: Path) -> bool:
    """Whether the file holds nothing but white space (read only when it is small)."""
    size = path.stat().st_size
    return size == 0 or (size <= 4096 and not path.read_bytes().strip())


def _arrow_column(path: Path, builder: str, text_field: str, key: str, tmp: str):
    """The column `text_field` of `path` loaded by `datasets` into `tmp`, quietly."""
    import datasets
    from datasets.utils import logging as ds_logging

    verbosity, bars = ds_logging.get_verbosity(), ds_logging.is_progress_bar_enabled()
    ds_logging.set_verbosity(ds_logging.CRITICAL + 10)  # silence its own error log too
    ds_logging.disable_progress_bar()
    try:
        ds = datasets.load_dataset(builder, data_files=[str(path)], split="train", cache_dir=tmp)
        if text_field not in ds.column_names:
            records = "chat" if "messages" in ds.column_names else "instruction"
            raise DataError(
                f"{key}={text_field!r} is not a column of {str(path)!r}; its "
                f"columns are {ds.column_names}. Fix: set {key} to the column holding it, "
                f"or --data.format={records} for {records} records (loss on the responses)."
            )
        return ds.data.column(text_field)
    except DataError:
        raise
    except Exception as exc:
        raise _unreadable(path, builder, exc) from exc
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars:
            ds_logging.enable_progress_bar()


def _unreadable(path: Path, builder: str, exc: BaseException) -> DataError:
    kind = {"json": "JSON / JSON lines", "csv": "CSV"}.get(builder, "Parquet")
    where = first_bad_line(path) if builder in ("json", "csv") else None
    return DataError(
        f"data file {str(path)!r} cannot be read as {kind}: "
        f"{where or _root_cause(exc)}. Fix: check that it is valid {kind}."
    )


def _root_cause(exc: BaseException) -> str:
    # datasets wraps the parser's error in a generic "error occurred while generating".
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return f"{type(exc).__name__}: {exc}".strip()
