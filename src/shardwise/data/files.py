"""What a data file must be before anything reads it: a regular file (never a FIFO, which
would block the first read forever, a dangling symlink or a symlink loop) holding text, not
binary data; and which directories a dataset scan leaves out (the run's own outputs)."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from shardwise.errors import DataError

# Bytes read from the start of a .txt file to tell text from binary data before reading it
# whole: a binary file (or a sparse one of NULs) shows a NUL byte in its first block.
SNIFF_BYTES = 65536

_KINDS = {
    stat.S_ISFIFO: "a FIFO (named pipe)",
    stat.S_ISSOCK: "a socket",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISDIR: "a directory",
}


def entry_problem(path: Path) -> str | None:
    """Why `path` is not a regular file data can be read from (None: it is one). Only
    `stat` is called: opening a FIFO would block until something writes to it."""
    try:
        mode = os.stat(path).st_mode  # follows symlinks
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symlink loop"
        if os.path.islink(path):
            return f"is a dangling symlink (to '{os.readlink(path)}', which does not exist)"
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS.items() if test(mode)), "not a regular file")
    return f"is {kind}, not a regular file"


def check_entries(dataset: str, files: list[Path]) -> None:
    """Refuse, in one message, the entries of a dataset scan that are not regular files."""
    bad = [(f, why) for f in files if (why := entry_problem(f)) is not None]
    if not bad:
        return
    shown = "; ".join(f"'{f}' {why}" for f, why in bad[:3]) + ("; ..." if len(bad) > 3 else "")
    raise DataError(
        f"data.dataset={dataset!r} holds {len(bad)} data entr{'y' if len(bad) == 1 else 'ies'} "
        f"that cannot be read as files: {shown}. Fix: remove them (or replace them with the "
        "files they stand for), or point data.dataset at the files to read."
    )


def check_text_start(path: Path) -> None:
    """Refuse a .txt file whose first block holds a NUL byte (binary data, or a sparse file)
    before it is read whole: such a file would be read, trained on and encoded in full."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    at = head.find(b"\0")
    if at >= 0:
        raise_nul(path, at, head.count(b"\n", 0, at) + 1)


def check_text(path: Path, text: str) -> None:
    """Refuse text holding a NUL character anywhere (binary data past the first block)."""
    at = text.find("\0")
    if at >= 0:
        raise_nul(path, at, text.count("\n", 0, at) + 1)


def raise_nul(path: Path, at: int, line: int) -> None:
    size = path.stat().st_size
    raise DataError(
        f"data file '{path}' ({size:,} bytes) holds binary data, not text: a NUL byte at "
        f"character {at} (line {line}). Fix: remove it from the dataset, or convert it to UTF-8 "
        "text first."
    )


def excluded_dirs(paths: tuple[str, ...]) -> set[Path]:
    """The resolved directories a dataset scan skips (run.dir, checkpoint.dir, the cache):
    a dataset folder that holds the run would otherwise read its metrics and checkpoint
    indexes as data on the next run."""
    return {Path(os.path.realpath(os.path.expanduser(p))) for p in paths if p}


def inside(path: Path, dirs: set[Path]) -> bool:
    """Whether `path` (resolved) is one of `dirs` or lies below one."""
    return any(path == d or d in path.parents for d in dirs)


def first_bad_line(path: Path) -> str | None:
    """'line N: why: the line's start' for the first line that is not UTF-8 or (JSON lines)
    not one JSON value, or holds a lone surrogate (a JSON escape such as \\ud800 without its
    pair: no UTF-8 text can hold it); a whole-file JSON document's parser position as a line;
    else None."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        start = data.rfind(b"\n", 0, exc.start) + 1
        # 0xED 0xA0..0xBF: a UTF-16 surrogate half written as if it were a character
        half = data[exc.start : exc.start + 2]
        why = "a lone surrogate" if half[:1] == b"\xed" and half[1:2] >= b"\xa0" else exc.reason
        return f"line {line} is not UTF-8 ({why} at byte {exc.start - start} of the line)"
    if path.suffix.lower() != ".jsonl" and text.lstrip().startswith(("[", "{")):
        try:
            value = json.loads(text)
        except ValueError as exc:
            lineno = getattr(exc, "lineno", None)
            return f"line {lineno}: {getattr(exc, 'msg', exc)}" if lineno else None
        surrogate = _surrogate(value)
        if surrogate:
            found = text.lower().find(surrogate)  # the escape may be spelt \\uD800
            at = f"line {text.count(chr(10), 0, found) + 1}" if found >= 0 else "the document"
            return f"{at} holds {_SURROGATE.format(surrogate)}"
        return None
    if path.suffix.lower() != ".jsonl":
        return None
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                surrogate = _surrogate(json.loads(line))
            except ValueError as exc:
                return f"line {n}: {getattr(exc, 'msg', exc)}: {line[:60]!r}"
            if surrogate:
                return f"line {n} holds {_SURROGATE.format(surrogate)}: {line[:60]!r}"
    return None


_SURROGATE = "the lone surrogate {}, which is not valid UTF-8 text (half of a UTF-16 pair)"


def _surrogate(value) -> str | None:
    """The JSON escape of the first lone surrogate in a parsed JSON value (None: none)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        return f"\\u{ord(exc.object[exc.start]):04x}"
