"""Text corpora: where documents come from and which of them are held out.

A corpus is either the Python standard library's own sources ("stdlib": ~10M tokens of real
text that every machine already has, so nothing is downloaded) or the user's files. Both end
up as a sorted list of files whose names, sizes and mtimes identify the cache, and as lists of
documents split into train and held-out sets by a stable hash of each document's id, so the
split never changes between runs, processes or machines.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardwise.data.columns import builder_of, iter_column
from shardwise.data.files import (
    check_entries,
    check_text,
    check_text_start,
    entry_problem,
    excluded_dirs,
    first_bad_line,
    inside,
)
from shardwise.errors import DataError

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".csv")
_FIX_DATASET = (
    "Fix: pass an existing .txt/.jsonl/.json/.csv/.parquet file, a directory or glob of them, "
    "'stdlib' or 'digits'."
)


@dataclass(frozen=True)
class DataSpec:
    """What to train on; mirrors the `data.*` config section."""

    dataset: str = (
        "stdlib"  # "stdlib" | "digits" | a .txt/.jsonl/.json/.csv/.parquet file, dir or glob
    )
    seq_len: int = 128  # tokens per sample (text)
    vocab_size: int = 4096  # BPE vocabulary size to train (text)
    text_field: str = "text"  # field holding the text in jsonl/json/parquet rows
    val_fraction: float = 0.02  # held-out fraction (documents for text, images for digits)
    image_size: int = 32  # digits are resized (bilinear) from 8x8 to this
    cache_dir: str = ""  # "" -> $SHARDWISE_CACHE or ~/.cache/shardwise
    tokenizer: str = ""  # a folder with a Hugging Face tokenizer; "" -> train a BPE (text)
    label_field: str = ""  # set: labelled rows for sequence classification (data/classify.py)
    format: str = "text"  # instruction | chat: one record per sample (data/instruct.py)
    fields: tuple[str, ...] = ()  # instruction: (prompt, input, response); chat: (messages,)
    pack: bool = False  # instruction | chat: several records per row (data/instruct.py)
    max_bad_rows: int = 100  # rows without a text value skipped (counted) before refusing
    # directories a dataset scan leaves out: the run's own outputs (run.dir, checkpoint.dir)
    exclude: tuple[str, ...] = ()
    blend: str = ""  # "PATH:WEIGHT,..." of text corpora, instead of `dataset` (data/blend.py)

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset.strip():
            raise DataError(f"data.dataset={self.dataset!r} is empty. {_FIX_DATASET}")
        if self.seq_len < 1:
            raise DataError(f"data.seq_len={self.seq_len} must be >= 1. Fix: use e.g. 128.")
        # A byte-level BPE needs its 256 byte tokens plus the end-of-text token.
        # Image models have no vocabulary (vocab_size 0), so only text data checks it.
        text = (
            self.dataset != "digits"
            and not self.is_user
            and not self.label_field
            and self.format == "text"
        )
        if text and not self.tokenizer and self.vocab_size < 257:
            raise DataError(
                f"data.vocab_size={self.vocab_size} is below the 257 tokens a byte-level BPE "
                "needs (256 bytes + <|endoftext|>). Fix: use e.g. 4096."
            )
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(
                f"data.val_fraction={self.val_fraction} must be in [0, 1). Fix: use e.g. 0.02."
            )
        if self.image_size < 1:
            raise DataError(f"data.image_size={self.image_size} must be >= 1. Fix: use e.g. 32.")

    @property
    def is_user(self) -> bool:
        """Your own dataset factory (data/user.py): `module:factory` or `file.py:factory`."""
        return ":" in self.dataset

    def cache_root(self) -> Path:
        """The directory holding every cached corpus."""
        root = self.cache_dir or os.environ.get("SHARDWISE_CACHE", "")
        return Path(root).expanduser() if root else Path.home() / ".cache" / "shardwise"


@dataclass(frozen=True)
class Source:
    """A resolved corpus: its files (absolute) and each file's stable document-id prefix."""

    label: str  # short human name, used in the cache directory name
    files: tuple[Path, ...]
    ids: tuple[str, ...]  # relative paths; documents are hashed by these, not absolute paths
    is_stdlib: bool

    def identity(self) -> list[tuple[str, int, int]]:
        """(path, size, mtime_ns) per file: changes whenever any file does."""
        out = []
        for path in self.files:
            st = path.stat()
            out.append((str(path), st.st_size, st.st_mtime_ns))
        return out


def stable_unit(key: str) -> float:
    """A number in [0, 1) from `key`, equal on every run and machine (unlike `hash()`)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


@functools.lru_cache(maxsize=1)
def _stdlib_source() -> Source:
    """The standard library's sources, walked once per process (it does not change while
    Python runs; each test case and both splits would otherwise walk ~3,500 files again)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(_walk(root, (".py",), skip={"site-packages"}), key=lambda p: p.as_posix())
    return Source("stdlib", tuple(files), tuple(_rel(p, root) for p in files), True)


def resolve_source(spec: DataSpec) -> Source:
    """Find the files behind `spec.dataset`; raise DataError if there are none usable."""
    if spec.dataset == "stdlib":
        return _stdlib_source()
    raw = spec.dataset
    path = Path(os.path.expanduser(raw))
    if path.is_file():
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise DataError(
                f"data.dataset={raw!r} has the unsupported extension {path.suffix!r}. "
                f"Fix: use a .txt, .jsonl, .json, .csv or .parquet file (or 'stdlib' or 'digits')."
            )
        path = path.resolve()
        return Source(_label(path.stem), (path,), (path.name,), False)
    skip = excluded_dirs((*spec.exclude, str(spec.cache_root())))
    if path.is_dir():
        root = path.resolve()
        files = sorted(_walk(root, SUPPORTED_SUFFIXES, skip), key=lambda p: p.as_posix())
        check_entries(raw, files)
        if not files:
            others = sorted({p.suffix or p.name for p in _walk(root, None, skip)})[:8]
            found = f"only {others} files" if others else "no files"
            raise DataError(
                f"data.dataset={raw!r} is a directory with {found}, no .txt/.jsonl/.json/.csv/"
                ".parquet files. Fix: point it at a directory holding such files."
            )
        return Source(_label(root.name), tuple(files), tuple(_rel(p, root) for p in files), False)
    if any(ch in raw for ch in "*?["):
        pattern = os.path.expanduser(raw)
        found = [Path(m) for m in glob.glob(pattern, recursive=True)]
        found = [m for m in found if not m.is_dir()]
        check_entries(raw, [m for m in found if m.suffix.lower() in SUPPORTED_SUFFIXES])
        # the run's outputs below the pattern's fixed part are left out, not the folder above
        base = Path(os.path.realpath(os.path.dirname(re.split(r"[*?\[]", pattern)[0])))
        skip = {d for d in skip if d != base and d not in base.parents}
        matches = sorted(Path(os.path.realpath(m)) for m in found)  # realpath: no loop error
        matches = [m for m in matches if not inside(m, skip)]
        files = [m for m in matches if m.suffix.lower() in SUPPORTED_SUFFIXES]
        if not files:
            what = f"{len(matches)} files, none of them" if matches else "no files, so no"
            raise DataError(
                f"data.dataset={raw!r} matches {what} .txt/.jsonl/.json/.csv/.parquet files. "
                "Fix: change the pattern so it matches such files."
            )
        root = Path(os.path.commonpath([str(f.parent) for f in files]))
        return Source(
            _label(root.name or "glob"), tuple(files), tuple(_rel(f, root) for f in files), False
        )
    if os.path.lexists(path):  # a FIFO, a socket, a dangling symlink, a symlink loop
        raise DataError(f"data.dataset={raw!r} {entry_problem(path)}. {_FIX_DATASET}")
    raise DataError(f"data.dataset={raw!r} does not exist. {_FIX_DATASET}")


def read_documents(
    source: Source, text_field: str, skipped: list[str] | None = None
) -> Iterator[tuple[str, str]]:
    """Yield (document id, text) for every non-empty document, in file order; the ids of rows
    whose text field is missing or null go into `skipped` (see `check_skipped`)."""
    if source.is_stdlib:
        for path, rel in zip(source.files, source.ids, strict=True):
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # the stdlib ships a few deliberately broken/latin-1 test files
            if text:
                yield rel, text
        return
    for path, rel in zip(source.files, source.ids, strict=True):
        suffix = path.suffix.lower()
        if suffix == ".txt":
            text = _read_txt(path)
            if text:
                yield rel, text  # a .txt file is one document
        else:
            yield from _read_rows(path, rel, suffix, text_field, skipped)


def split_documents(
    docs: list[tuple[str, str]], val_fraction: float, dataset: str
) -> tuple[list[str], list[str]]:
    """Split into (train texts, val texts) by the stable hash of each document id.

    Never random per run. If the hash picks no held-out document although val_fraction > 0,
    the document with the smallest hash is held out. A corpus of one document (e.g. a single
    .txt file) is instead cut at a line break so that its tail holds val_fraction of the text.
    """
    if not docs or not any(text for _, text in docs):
        raise DataError(
            f"data.dataset={dataset!r} holds no text (0 documents or 0 characters). "
            "Fix: point it at non-empty files."
        )
    if val_fraction <= 0:
        return [text for _, text in docs], []
    if len(docs) == 1:
        head, tail = cut_single(docs[0][1], val_fraction)
        return [head], [tail]
    units = [stable_unit(doc_id) for doc_id, _ in docs]
    is_val = [u < val_fraction for u in units]
    if not any(is_val):
        is_val[min(range(len(docs)), key=units.__getitem__)] = True
    if all(is_val):  # keep at least one training document
        is_val[max(range(len(docs)), key=units.__getitem__)] = False
    train = [text for (_, text), v in zip(docs, is_val, strict=True) if not v]
    val = [text for (_, text), v in zip(docs, is_val, strict=True) if v]
    return train, val


def cut_single(text: str, val_fraction: float) -> tuple[str, str]:
    """A corpus of one document: (head to train on, tail held out), cut at the line break
    before the point that leaves val_fraction of the text in the tail."""
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.rfind("\n", 0, cut)
    cut = newline + 1 if newline > 0 else cut
    return text[:cut], text[cut:]


def _walk(root: Path, suffixes: tuple[str, ...] | None, skip: set) -> Iterator[Path]:
    """Files under `root` whose names end in `suffixes` (None: all); `skip` holds directory
    names, or resolved directories (the run's outputs), left out."""
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden directories (.git, .cache) never hold the user's corpus.
        dirnames[:] = [
            d
            for d in dirnames
            if d not in skip
            and not d.startswith(".")
            and Path(os.path.realpath(os.path.join(dirpath, d))) not in skip
        ]
        for name in filenames:
            if suffixes is None or name.lower().endswith(suffixes):
                yield Path(dirpath) / name


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _label(name: str) -> str:
    clean = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)[:40]
    return clean or "data"


def _read_txt(path: Path) -> str:
    try:
        check_text_start(path)  # binary data is refused before it is read whole
        text = path.read_text(encoding="utf-8")
        check_text(path, text)
        return text
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data file {str(path)!r} is not UTF-8 text: {first_bad_line(path)}. "
            "Fix: re-encode it as UTF-8."
        ) from exc
    except OSError as exc:
        raise DataError(f"data file {str(path)!r} cannot be read: {exc}. Fix: check it.") from exc


def _read_rows(
    path: Path, rel: str, suffix: str, text_field: str, skipped: list[str] | None
) -> Iterator[tuple[str, str]]:
    values = iter_column(path, builder_of(suffix), text_field)
    for i, value in enumerate(values):
        if value is None and skipped is not None:  # the field missing (or null) in this row
            skipped.append(f"{rel} row {i + 1}")
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise DataError(
                f"data.text_field={text_field!r} holds a value of type {type(value).__name__} in "
                f"row {i} of "
                f"{str(path)!r}, not text. Fix: set data.text_field to a string column."
            )
        yield f"{rel}#{i}", value


def check_skipped(
    count: int, examples: list[str], field: str, limit: int, say: bool = False
) -> None:
    """Refuse the data when more than `limit` rows had no `field` value; else, with `say`,
    tell how many were skipped."""
    if not count:
        return
    shown = ", ".join(examples) + (", ..." if count > len(examples) else "")
    if count > limit:
        raise DataError(
            f"{count} rows have no {field!r} value ({shown}): more than "
            f"data.max_bad_rows={limit}. Fix: repair those rows, set data.text_field to the "
            f"field that holds the text, or --data.max_bad_rows={count} to skip them."
        )
    if say:
        print(f"shardwise: skipped {count} rows without a {field!r} value ({shown})")
