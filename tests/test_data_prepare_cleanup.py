"""A `shardwise data prepare` refused half-way removes exactly what it wrote: the shards,
manifests, tokenizer.json and lock it made, and --out when it made it (an --out that existed,
empty, stays, empty). A Ctrl-C removes nothing (the rerun continues), and a lock file removed
by its holder while another process was opening it is never held twice."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.data import dirlock
from shardwise.data.dirlock import LOCK, lock_dir
from shardwise.data.encode import Encoder, encode_all
from shardwise.data.prepare import Options, prepare
from shardwise.data.shards import PARTIAL
from shardwise.errors import DataError
from support.compare import VOCAB
from test_data_prepare import SMALL_SHARDS, _corpus, _refused


def _bad_tail(root: Path) -> Path:
    """A corpus whose last file is not UTF-8 after good bytes: found only by reading it."""
    corpus = _corpus(root)
    (corpus / "zz.txt").write_bytes(b"a good start, then \xff\xfe and no more text")
    return corpus


def _cut_mid_encode(corpus: Path, out: Path, recorded: list[str]) -> None:
    """A prepare whose last input file loses most of its documents after the first shard is
    recorded: the encoding pass finds fewer documents than the scan planned."""

    def cut_an_input(name: str) -> None:
        recorded.append(name)
        rows = corpus / "rows.jsonl"
        rows.write_text("".join(rows.read_text().splitlines(keepends=True)[:2]))

    opts = Options((str(corpus),), str(out), vocab_size=VOCAB, shard_mb=SMALL_SHARDS, workers=1)
    prepare(opts, on_shard=cut_an_input)


def test_a_refusal_found_while_reading_leaves_no_out_it_created(tmp_path, capsys):
    """An input undecodable in its last file (found by the scan, after --out is locked):
    the --out it created is gone, through the API and the command line alike (one line,
    exit 2); an --out that existed, empty, stays, empty."""
    corpus = _bad_tail(tmp_path / "corpus")
    out = tmp_path / "new" / "out"
    _refused(r"zz.txt' is not UTF-8 text", lambda: _prepare_to(corpus, out))
    assert not out.exists() and (tmp_path / "new").is_dir()  # (--out only, not its parent)
    argv = ["data", "prepare", str(corpus), "--out", str(out), "--vocab-size", str(VOCAB)]
    assert main(argv) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err and not out.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    _refused(r"zz.txt' is not UTF-8 text", lambda: _prepare_to(corpus, mine))
    assert mine.is_dir() and not list(mine.iterdir())


def test_a_refusal_after_shards_were_written_removes_them_and_a_ctrl_c_keeps_them(tmp_path):
    """An input cut short while the encoding pass runs: shards were recorded, then refused; every
    file of that prepare and the --out it created are gone (an existing empty --out stays,
    empty). The same prepare stopped by Ctrl-C keeps its shards for the rerun."""
    for out in (tmp_path / "out", tmp_path / "existing"):
        if out.name == "existing":
            out.mkdir()
        corpus, recorded = _corpus(tmp_path / f"corpus-{out.name}"), []
        with pytest.raises(DataError, match=r"gave fewer \w+ documents than when this"):
            _cut_mid_encode(corpus, out, recorded)
        assert recorded  # shards were written before the refusal
        assert out.exists() == (out.name == "existing")
        assert not out.exists() or not list(out.iterdir())

    def stop(name: str) -> None:
        raise KeyboardInterrupt

    corpus, out = _corpus(tmp_path / "corpus-stopped"), tmp_path / "stopped"
    opts = Options((str(corpus),), str(out), vocab_size=VOCAB, shard_mb=SMALL_SHARDS, workers=1)
    with pytest.raises(KeyboardInterrupt):
        prepare(opts, on_shard=stop)
    left = {p.name for p in out.iterdir()}
    assert {PARTIAL, "tokenizer.json", LOCK} <= left and any(n.endswith(".bin") for n in left)


def test_a_refused_rerun_of_an_unfinished_prepare_keeps_the_earlier_runs_files(tmp_path):
    """A Ctrl-C'd prepare left shards; its rerun, refused half-way, removes the shards it wrote
    itself and keeps the earlier run's files (lock file included) as they were."""
    corpus, out = _corpus(tmp_path / "corpus"), tmp_path / "out"

    def stop(name: str) -> None:
        raise KeyboardInterrupt

    opts = Options((str(corpus),), str(out), vocab_size=VOCAB, shard_mb=SMALL_SHARDS, workers=1)
    with pytest.raises(KeyboardInterrupt):
        prepare(opts, on_shard=stop)
    earlier = {p.name: p.stat().st_ino for p in out.iterdir()}
    recorded: list[str] = []
    with pytest.raises(DataError, match="gave fewer"):
        _cut_mid_encode(corpus, out, recorded)
    assert recorded and not set(recorded) & set(earlier)  # it wrote shards of its own
    left = {p.name: p.stat().st_ino for p in out.iterdir()}
    assert set(left) == set(earlier)  # its own shards gone, the earlier run's all there
    kept = [n for n in earlier if n.endswith(".bin")]
    assert kept and all(left[n] == earlier[n] for n in kept)


def test_a_document_the_tokenizer_cannot_encode_is_refused_by_its_start(tmp_path):
    """The tokenizer failing on a document (a lone surrogate) is one DataError naming the
    document's start, in this process and from a worker process alike."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    encoder = Encoder(tok.to_str(), False, 0, "uint16")
    work = [("train-00000.bin", ["fine text", "broken \ud800 text"], True)]
    for workers in (1, 2):
        with pytest.raises(DataError, match=r"cannot encode the document that begins 'broken "):
            encode_all(iter(work), encoder, tmp_path, workers, lambda *a: None)


def test_a_lock_file_removed_by_its_holder_is_never_held_twice(tmp_path, monkeypatch):
    """A process opens the lock file, its holder removes it and lets go, then the process
    takes the lock: it notices the file is gone and locks a new one, so a third owner is
    refused (it would otherwise lock the new file beside the first's orphan)."""
    first = lock_dir(tmp_path, "d", "prepare", "clash", "--out", DataError)
    flock = dirlock.flock_or_holder
    calls = []

    def holder_leaves_first(fh) -> str | None:
        if not calls:
            os.unlink(tmp_path / LOCK)  # the refused holder's clean-up, then it lets go
            first.close()
        calls.append(1)
        return flock(fh)

    monkeypatch.setattr(dirlock, "flock_or_holder", holder_leaves_first)
    second = lock_dir(tmp_path, "d", "prepare", "clash", "--out", DataError)
    monkeypatch.setattr(dirlock, "flock_or_holder", flock)
    try:
        assert len(calls) == 2  # the orphan, then the new file
        assert os.fstat(second.fileno()).st_ino == (tmp_path / LOCK).stat().st_ino
        with pytest.raises(DataError, match=rf"in use .*pid {os.getpid()}"):
            lock_dir(tmp_path, "d", "prepare", "clash", "--out", DataError)
    finally:
        second.close()


def _prepare_to(corpus: Path, out: Path) -> dict:
    return prepare(
        Options((str(corpus),), str(out), vocab_size=VOCAB, shard_mb=SMALL_SHARDS, workers=1)
    )


@pytest.mark.parametrize("forget", [True, False])
def test_a_forked_worker_holds_no_lock_once_its_parent_lets_go(tmp_path, forget):
    """A forked encoding worker inherits the prepare's --out lock descriptor, and a flock lasts
    while any copy is open: a worker outliving a SIGKILLed prepare would refuse every rerun.
    The pool's initializer closes the copies (forget_inherited), so the lock ends with its
    taker; without that call the child's copy keeps it (the control case)."""
    taken = lock_dir(tmp_path, "d", "prepare", "clash", "--out", DataError)
    go, ready = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: drop the copies (or not), say so, wait to be told to end
        try:
            if forget:
                dirlock.forget_inherited()
            os.write(ready[1], b"r")
            os.read(go[0], 1)
        finally:
            os._exit(0)
    try:
        os.read(ready[0], 1)
        taken.close()  # the parent lets go (as its death would) while the worker still runs
        if forget:
            lock_dir(tmp_path, "d", "prepare", "clash", "--out", DataError).close()
        else:
            with pytest.raises(DataError, match="is in use by another shardwise prepare"):
                lock_dir(tmp_path, "d", "prepare", "clash", "--out", DataError)
    finally:
        os.write(go[1], b"g")
        os.waitpid(pid, 0)
        for fd in (*go, *ready):
            os.close(fd)
