"""`shardwise data prepare` never loses or overwrites the user's work: one prepare at a time
owns --out (a second is refused naming the holder; a killed holder's lock does not block the
rerun), an --out holding others' files or the inputs themselves is refused untouched, bad
inputs and tokenizers are refused before anything is written, and a training job reading a
finished directory keeps reading the same shard files while prepare runs again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.cli.main import main
from shardwise.data import load_data
from shardwise.data.dirlock import LOCK
from shardwise.data.shards import PARTIAL
from support.compare import VOCAB
from support.textdata import spec as _spec
from support.textdata import text as _text
from test_data_prepare import SMALL_SHARDS, _corpus, _hf_tokenizer, _prepare, _refused

# A real prepare that stops after its first recorded shard until `go` exists: the holder.
_HOLDER = """
import sys, time
from pathlib import Path
from shardwise.data.prepare import Options, prepare
corpus, out, go = sys.argv[1:4]
def wait(name):
    print("recorded", name, flush=True)
    while not Path(go).exists():
        time.sleep(0.02)
prepare(Options((corpus,), out, vocab_size=int(sys.argv[4]), shard_mb=float(sys.argv[5]),
                workers=1), on_shard=wait)
"""


def _files(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """name -> (inode, mtime_ns, bytes) of every file directly in `root`."""
    out = {}
    for p in sorted(root.iterdir()):
        st = p.stat()
        out[p.name] = (st.st_ino, st.st_mtime_ns, p.read_bytes())
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _corpus(tmp_path_factory.mktemp("c") / "corpus")


def test_a_second_prepare_into_a_held_out_is_refused_and_a_killed_holder_does_not_block(
    corpus, tmp_path, capsys
):
    """A real prepare (its own process) stopped after one recorded shard holds --out: a second
    prepare into it is refused in one line naming the path and the holder's pid, and leaves
    every file there as it was. SIGKILLed, the holder's lock dies with it: the rerun takes
    over, keeps the recorded shard and ends with the manifest of an uninterrupted prepare."""
    out, go = tmp_path / "out", tmp_path / "go"
    argv = [sys.executable, "-c", _HOLDER, str(corpus), str(out), str(go), str(VOCAB)]
    holder = subprocess.Popen([*argv, str(SMALL_SHARDS)], stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        line = holder.stdout.readline()  # blocks until its first shard is recorded
        assert line.startswith("recorded"), line
        before = _files(out)
        message = _refused(
            rf"--out '{re.escape(str(out))}' is in use by another shardwise data prepare "
            rf"\(host .*, pid {holder.pid}, since .*two prepares would overwrite each other's",
            _prepare,
            [corpus],
            out,
        )
        assert "Fix: wait for it to end, or give this data prepare another --out" in message
        assert _files(out) == before
        capsys.readouterr()
        cli = ["data", "prepare", str(corpus), "--out", str(out), "--vocab-size", str(VOCAB)]
        assert main([*cli, "--shard-mb", str(SMALL_SHARDS)]) == 2  # the CLI: one line
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"pid {holder.pid}" in err[0]
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
    assert f"pid {holder.pid}" in (out / LOCK).read_text()  # the dead holder's line is left
    recorded = line.split()[1]
    kept = (out / recorded).stat().st_ino
    m = _prepare([corpus], out)
    assert (out / recorded).stat().st_ino == kept and not (out / PARTIAL).exists()
    assert f"pid {os.getpid()}" in (out / LOCK).read_text()
    assert m["splits"] == _prepare([corpus], tmp_path / "whole")["splits"]


def test_an_out_with_others_files_is_refused_naming_a_few_and_left_untouched(corpus, tmp_path):
    """Foreign files are named (three, then '...') with the fix, in a directory that holds
    nothing of ours and beside an unfinished prepare's files alike; nothing is written."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name in ("a.txt", "b.bin", "c.json", "train-1.bin", "notes"):
        (theirs / name).write_text(name)
    before = _files(theirs)
    _refused(r"holds 5 entries .* \('a.txt', 'b.bin', 'c.json', \.\.\.\).*Fix: --out naming a "
             "new or empty directory", _prepare, [corpus], theirs)  # fmt: skip
    assert _files(theirs) == before  # not even a lock file

    out = tmp_path / "out"

    def stop(name: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        from shardwise.data.prepare import Options, prepare

        prepare(Options((str(corpus),), str(out), vocab_size=VOCAB, shard_mb=SMALL_SHARDS,
                        workers=1), on_shard=stop)  # fmt: skip
    (out / "mine.txt").write_text("the user's")
    before = _files(out)
    _refused(r"holds 1 entry .* beside an unfinished prepare's files \('mine.txt'\)",
             _prepare, [corpus], out)  # fmt: skip
    assert _files(out) == before


def test_an_out_that_is_holds_or_lies_inside_an_input_is_refused_untouched(corpus, tmp_path):
    """--out equal to the corpus directory or above it would read its own files as documents
    and write among the user's; inside it, its shards, manifest and tokenizer.json would be
    documents of the corpus for every later reader (training on it, another prepare; a
    recursive glob alike). Each is refused by name before anything is written."""
    before = _files(corpus)
    _refused(r"--out '.*corpus' holds INPUT '.*corpus' .*Fix: --out naming a new directory "
             "outside the inputs", _prepare, [corpus], corpus)  # fmt: skip
    _refused(r"--out '.*' holds INPUT", _prepare, [corpus], corpus.parent)
    inside = corpus / "prepared"
    _refused(r"--out '.*prepared' lies inside INPUT '.*corpus': its shards, manifest and "
             "tokenizer.json would become documents", _prepare, [corpus], inside)  # fmt: skip
    recursive = f"hf:json:data_files={corpus}/**/*.jsonl"
    _refused("lies inside INPUT 'hf:json", _prepare, [recursive], inside)
    assert _files(corpus) == before and not inside.exists()
    beside = _prepare([f"{corpus}/*.txt"], corpus.parent / "beside")  # a glob that stops above
    assert beside["splits"]["train"]["docs"] + beside["splits"]["val"]["docs"] == 24


def test_missing_or_empty_inputs_and_a_missing_tokenizer_are_refused_before_writing(
    corpus, tmp_path
):
    """An input that does not exist, an empty directory, an empty file and a --tokenizer
    folder that does not exist (or holds no tokenizer) are refused by name before --out is
    created; the rerun with the right tokenizer is not blocked by anything left behind."""
    out = tmp_path / "out"
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.txt").write_text("")
    for inputs, match in (
        ([tmp_path / "nope"], r"INPUT '.*nope' does not exist"),
        ([tmp_path / "empty_dir"], r"INPUT '.*empty_dir' is a directory with no files"),
        ([corpus, tmp_path / "empty.txt"], r"INPUT '.*empty.txt' holds no text"),
    ):
        _refused(match, _prepare, inputs, out)
        assert not out.exists()
    _refused(r"--tokenizer '.*no-tok' does not exist .*Fix: the folder "
             "tokenizer.save_pretrained wrote", _prepare, [corpus], out,
             tokenizer=str(tmp_path / "no-tok"))  # fmt: skip
    _refused(r"--tokenizer '.*empty_dir' holds no tokenizer", _prepare, [corpus], out,
             tokenizer=str(tmp_path / "empty_dir"))  # fmt: skip
    assert not out.exists()
    tok = _hf_tokenizer(tmp_path / "tok")
    assert _prepare([corpus], out, tokenizer=str(tok))["tokenizer"]["kind"] == "hf"


def test_prepare_again_while_training_reads_the_directory_changes_no_shard(tmp_path):
    """A training job memory-maps a finished directory's shards. Prepare run again into it,
    with the same command (nothing to do), other options or a changed input (refused), leaves
    every file as it was (inode, mtime, bytes), and the job's batches are the same."""
    corpus, out = _corpus(tmp_path / "corpus"), tmp_path / "out"
    _prepare([corpus], out)
    reader = load_data(_spec(tmp_path, out, vocab_size=VOCAB, seq_len=16), "train")
    every = torch.arange(len(reader))
    first = reader.get_batch(every)
    before = _files(out)
    _prepare([corpus], out)
    _refused("--val-fraction 0.1 differs from the finished prepare", _prepare, [corpus], out,
             val_fraction=0.1)  # fmt: skip
    (corpus / "d03.txt").write_text(_text(42, 300))
    _refused(r"the inputs .* differ .*d03.txt' changed", _prepare, [corpus], out)
    assert _files(out) == before
    for a, b in zip(first, reader.get_batch(every), strict=True):
        assert torch.equal(a, b)
