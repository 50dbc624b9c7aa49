"""shardwise.data: sampler layout invariance, corpora, caches, digits and every DataError."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.data import (
    DataSpec,
    GlobalSampler,
    ImageDataset,
    TokenDataset,
    load_data,
    prepare_data,
    split_for_rank,
)
from shardwise.errors import DataError
from support.textdata import WORDS
from support.textdata import spec as _spec
from support.textdata import text as _text


@pytest.fixture
def txt_dir(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i in range(12):
        (root / ("sub" if i % 2 else "") / f"doc{i:02d}.txt").write_text(_text(i, 400))
    (root / "README.md").write_text("not part of the corpus")
    return root


# --- sampler -------------------------------------------------------------------------------


def test_sampler_is_a_function_of_seed_and_step() -> None:
    a, b = GlobalSampler(100, 8, seed=1), GlobalSampler(100, 8, seed=1)
    assert all(torch.equal(a.global_indices(s), b.global_indices(s)) for s in range(30))
    assert not torch.equal(a.global_indices(0), GlobalSampler(100, 8, seed=2).global_indices(0))
    assert a.global_indices(0).dtype == torch.int64


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_split_for_rank_union_is_the_global_batch(dp: int) -> None:
    sampler = GlobalSampler(1000, 16, seed=3)
    for step in range(5):
        batch = sampler.global_indices(step)
        for micro in [m for m in (1, 2, 4) if (16 // dp) % m == 0]:
            parts = [mb for r in range(dp) for mb in split_for_rank(batch, r, dp, micro)]
            assert all(len(mb) == micro for mb in parts)
            assert torch.equal(torch.cat(parts), batch)


def test_epochs_wrap_and_each_epoch_is_a_permutation() -> None:
    n, g = 10, 4  # batches straddle epoch boundaries
    sampler = GlobalSampler(n, g, seed=0)
    stream = torch.cat([sampler.global_indices(s) for s in range(15)])  # 60 = 6 epochs
    epochs = stream.view(6, n)
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(n))
    assert len({tuple(e.tolist()) for e in epochs}) > 1  # reshuffled every epoch
    big = GlobalSampler(3, 8, seed=0).global_indices(1)  # batch larger than the data set
    assert sorted(big[1:4].tolist()) == [0, 1, 2]  # positions 9..11 are epoch 3


def test_sampler_resumes_from_any_step_without_state() -> None:
    warm = GlobalSampler(50, 6, seed=9)
    history = [warm.global_indices(s) for s in range(40)]
    for step in (0, 7, 8, 33, 39):
        assert torch.equal(GlobalSampler(50, 6, seed=9).global_indices(step), history[step])
    assert torch.equal(warm.global_indices(3), history[3])  # going back works too


def test_split_for_rank_rejects_indivisible_batches() -> None:
    batch = torch.arange(12)
    with pytest.raises(ValueError, match="not divisible by the data-parallel degree 5"):
        split_for_rank(batch, 0, 5, 1)
    with pytest.raises(ValueError, match=r"per-rank batch 6 .* micro_batch 4"):
        split_for_rank(batch, 1, 2, 4)


# --- text corpora --------------------------------------------------------------------------


def _check_batches(ds: TokenDataset, seq_len: int) -> None:
    assert ds.kind == "text" and ds.seq_len == seq_len and ds.tokens_per_sample == seq_len
    assert len(ds) == (len(ds.tokens) - 1) // seq_len > 0
    idx = torch.tensor([0, len(ds) - 1, 1])
    x, y = ds.get_batch(idx)
    assert x.shape == y.shape == (3, seq_len) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    last = torch.from_numpy(np.array(ds.tokens[(len(ds) - 1) * seq_len :][: seq_len + 1]))
    assert torch.equal(y[1], last[1:].long())
    assert int(x.max()) < ds.vocab_size


def test_directory_of_txt_files(tmp_path: Path, txt_dir: Path, capsys) -> None:
    spec = _spec(tmp_path, txt_dir, val_fraction=0.2)
    train, val = load_data(spec, "train"), load_data(spec, "val")
    assert "training a 300-token BPE" in capsys.readouterr().err
    for ds in (train, val):
        assert isinstance(ds, TokenDataset)
        _check_batches(ds, 16)
    assert train.vocab_size <= 300 and train.tokens.dtype == np.uint16
    # One EOS after every document: 12 documents in all, split between train and val.
    n_eos = sum(int((np.asarray(d.tokens) == d.eos_id).sum()) for d in (train, val))
    assert n_eos == 12 and (np.asarray(val.tokens) == val.eos_id).sum() >= 1
    text = train.tokenizer().decode(np.asarray(train.tokens).tolist())  # EOS is skipped
    assert set(text.split()) == set(WORDS)
    # Cached: a second call (any process) does no work and prints nothing.
    prepare_data(spec)
    assert capsys.readouterr().err == ""
    assert len(list((tmp_path / "cache").iterdir())) == 1
    # The held-out documents are the same whatever the path or run.
    again = load_data(_spec(tmp_path / "other", txt_dir, val_fraction=0.2), "val")
    assert np.array_equal(np.asarray(again.tokens), np.asarray(val.tokens))


def test_changed_file_rebuilds_the_cache(tmp_path: Path, txt_dir: Path) -> None:
    spec = _spec(tmp_path, txt_dir)
    prepare_data(spec)
    (txt_dir / "doc00.txt").write_text(_text(99, 500))
    prepare_data(spec)
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_single_txt_file_holds_out_its_tail(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_text(_text(0, 3000))
    spec = _spec(tmp_path, path, val_fraction=0.1)
    train, val = load_data(spec, "train"), load_data(spec, "val")
    assert 5 < len(train.tokens) / len(val.tokens) < 15


def test_jsonl_json_and_parquet_with_text_field(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"body": _text(i, 60), "id": i} for i in range(40)]
    (tmp_path / "d").mkdir()
    with open(tmp_path / "d" / "a.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[:15])
    (tmp_path / "d" / "b.json").write_text(json.dumps(rows[15:25]))
    pq.write_table(pa.Table.from_pylist(rows[25:]), tmp_path / "d" / "c.parquet")
    (tmp_path / "d" / "e.jsonl").write_text("")  # empty: no rows, like an empty .txt
    for dataset in (tmp_path / "d", str(tmp_path / "d" / "*.parquet")):
        spec = _spec(tmp_path, dataset, text_field="body", val_fraction=0.1)
        for split in ("train", "val"):
            _check_batches(load_data(spec, split), 16)
    train = load_data(_spec(tmp_path, tmp_path / "d", text_field="body", val_fraction=0.1), "train")
    val = load_data(_spec(tmp_path, tmp_path / "d", text_field="body", val_fraction=0.1), "val")
    assert (np.asarray(train.tokens) == train.eos_id).sum() + (
        np.asarray(val.tokens) == val.eos_id
    ).sum() == 40  # one document per row


def _raises(spec: DataSpec, *fragments: str, split: str = "train") -> str:
    with pytest.raises(DataError) as info:
        load_data(spec, split)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "Fix:" in message
    return message


def test_path_errors(tmp_path: Path) -> None:
    _raises(_spec(tmp_path, tmp_path / "nope.txt"), "nope.txt' does not exist", "'stdlib'")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "notes.md").write_text("x")
    _raises(_spec(tmp_path, tmp_path / "empty_dir"), "directory with only ['.md'] files")
    _raises(_spec(tmp_path, str(tmp_path / "*.xml")), "matches no files")
    (tmp_path / "t.xml").write_text("a,b\n")
    _raises(_spec(tmp_path, tmp_path / "t.xml"), "unsupported extension '.xml'")
    _raises(_spec(tmp_path, str(tmp_path / "*.xml")), "matches 1 files, none of them")


def test_content_errors(tmp_path: Path) -> None:
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "a.txt").write_text("")
    (tmp_path / "e" / "b.txt").write_text("")
    _raises(_spec(tmp_path, tmp_path / "e"), "holds no text (0 documents or 0 characters)")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    _raises(_spec(tmp_path, tmp_path / "latin1.txt"), "latin1.txt' is not UTF-8", "re-encode")
    (tmp_path / "rows.jsonl").write_text('{"content": "hello", "id": 1}\n')
    _raises(
        _spec(tmp_path, tmp_path / "rows.jsonl"),
        "data.text_field='text' is not a column",
        "['content', 'id']",
    )
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    _raises(_spec(tmp_path, tmp_path / "bad.jsonl"), "bad.jsonl' cannot be read as JSON")
    (tmp_path / "bad.parquet").write_bytes(b"garbage, not parquet")
    _raises(_spec(tmp_path, tmp_path / "bad.parquet"), "cannot be read as Parquet")
    (tmp_path / "blank").mkdir()  # empty records files hold no rows, as empty .txt files
    (tmp_path / "blank" / "a.jsonl").write_text("")
    (tmp_path / "blank" / "b.csv").write_text("\n \n")
    _raises(_spec(tmp_path, tmp_path / "blank"), "holds no text (0 documents or 0 characters)")
    (tmp_path / "nums.jsonl").write_text('{"text": 3}\n')
    _raises(_spec(tmp_path, tmp_path / "nums.jsonl"), "holds a value of type int in row 0")


def test_too_few_tokens(tmp_path: Path, txt_dir: Path) -> None:
    msg = _raises(
        _spec(tmp_path, txt_dir, seq_len=100_000), "train tokens", "data.seq_len+1=100001"
    )
    assert "smaller data.seq_len (at most" in msg
    one = tmp_path / "one.txt"
    one.write_text(_text(0, 3000))  # one document: val is its last ~1% (a few lines)
    _raises(_spec(tmp_path, one, seq_len=500, val_fraction=0.01), "val tokens", "val_fraction")


def test_spec_and_split_errors(tmp_path: Path, txt_dir: Path) -> None:
    _raises(_spec(tmp_path, txt_dir, val_fraction=0.0), "no 'val' split", split="val")
    with pytest.raises(DataError, match=r"data.vocab_size=100 is below the 257"):
        DataSpec(vocab_size=100)
    with pytest.raises(DataError, match=r"data.val_fraction=1.5 must be in \[0, 1\)"):
        DataSpec(val_fraction=1.5)
    with pytest.raises(DataError, match=r"data\.seq_len=0"):
        DataSpec(seq_len=0)
    with pytest.raises(ValueError, match="split='test'"):
        load_data(DataSpec(dataset="digits"), "test")


def test_concurrent_prepare_builds_one_cache(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    for i in range(30):
        (tmp_path / "c" / f"{i}.txt").write_text(_text(i, 2000))
    start = time.time() + 4.0  # both processes import first, then race on the lock
    script = textwrap.dedent(f"""
        import time
        from shardwise.data import DataSpec, prepare_data, load_data
        spec = DataSpec(dataset={str(tmp_path / "c")!r}, seq_len=32, vocab_size=400,
                        cache_dir={str(tmp_path / "cache")!r})
        time.sleep(max(0.0, {start} - time.time()))
        prepare_data(spec)
        print(len(load_data(spec, "train")))
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(err.count("training a 400-token BPE") for _, err in outs) == 1, outs
    assert outs[0][0] == outs[1][0] and int(outs[0][0]) > 0
    (cache,) = (tmp_path / "cache").iterdir()
    assert sorted(p.name for p in cache.iterdir()) == [
        ".lock", "meta.json", "tokenizer.json", "train.bin", "val.bin",
    ]  # fmt: skip


# --- digits and stdlib ---------------------------------------------------------------------


def test_digits() -> None:
    spec = DataSpec(dataset="digits", image_size=16, vocab_size=0)  # image models: no vocab
    prepare_data(spec)  # nothing to do, must not fail
    train, val = load_data(spec, "train"), load_data(spec, "val")
    assert isinstance(train, ImageDataset) and train.kind == "image" and train.num_classes == 10
    assert len(train) + len(val) == 1797 and len(val) == round(1797 * 0.2)  # 0.02 -> 0.2
    assert set(train.indices.tolist()).isdisjoint(val.indices.tolist())
    x, y = train.get_batch(torch.arange(len(train)))
    assert x.shape == (len(train), 1, 16, 16) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-3
    vx, _ = val.get_batch(torch.tensor([0, 1, 2]))
    assert vx.shape == (3, 1, 16, 16) and train.tokens_per_sample == 1 and train.image_size == 16
    bigger = load_data(DataSpec(dataset="digits", val_fraction=0.5), "val")
    assert len(bigger) == round(1797 * 0.5) and bigger.image_size == 32


def test_stdlib_corpus() -> None:
    # The real default cache (~/.cache/shardwise or $SHARDWISE_CACHE): built once per
    # machine (~25 s on 2 cores), then shared with every run and test.
    spec = DataSpec(dataset="stdlib", seq_len=128)
    train = load_data(spec, "train")
    val = load_data(spec, "val")
    assert len(train.tokens) > 1_000_000 and len(val.tokens) > 10_000
    assert train.vocab_size == 4096 and len(train) == (len(train.tokens) - 1) // 128
    _check_batches(train, 128)
    decoded = train.tokenizer().decode(train.get_batch(torch.tensor([10]))[0][0].tolist())
    assert len(decoded) > 128  # BPE merges: well over one character per token


def test_a_csv_file_is_a_text_corpus(tmp_path: Path) -> None:
    """CSV rows (data.text_field's column) read like JSON lines rows: one document each."""
    rows = [f"row {i}: " + " ".join(random.Random(i).choice("ab cd ef") for _ in range(40))
            for i in range(30)]  # fmt: skip
    path = tmp_path / "rows.csv"
    path.write_text("id,text\n" + "".join(f'{i},"{r}"\n' for i, r in enumerate(rows)))
    spec = DataSpec(str(path), seq_len=8, vocab_size=300, cache_dir=str(tmp_path / "c"))
    data = load_data(spec, "train")
    text = data.tokenizer().decode([int(t) for t in data.tokens])
    kept = [r for r in rows if r in text]
    assert len(kept) >= 20 and all(r.startswith("row ") for r in kept)


def test_bad_rows_are_named_by_line(tmp_path: Path) -> None:
    good = json.dumps({"text": "hello"})
    (tmp_path / "broken.jsonl").write_text(f'{good}\n{good}\n{{"text": "a"\n{good}\n')
    _raises(_spec(tmp_path, tmp_path / "broken.jsonl"), "line 3: Expecting ',' delimiter")
    (tmp_path / "latin.jsonl").write_bytes(f"{good}\n".encode() + b'{"text": "caf\xe9"}\n')
    _raises(_spec(tmp_path, tmp_path / "latin.jsonl"), "line 2 is not UTF-8")
    (tmp_path / "doc.txt").write_bytes(b"fine\nfine\nbad \xff here\n")
    _raises(_spec(tmp_path, tmp_path / "doc.txt"), "line 3 is not UTF-8", "re-encode")
    (tmp_path / "whole.json").write_text('[\n {"text": "a"},\n {"text": "b"\n]\n')
    _raises(_spec(tmp_path, tmp_path / "whole.json"), "line 4: Expecting ',' delimiter")


def test_rows_without_text_are_counted_and_refused_above_the_limit(tmp_path: Path, capsys):
    rows = [{"text": _text(i, 120)} for i in range(40)] + [{"other": 1}] * 3 + [{"text": None}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_data(_spec(tmp_path, path))
    assert "skipped 4 rows without a 'text' value (rows.jsonl row 41, " in capsys.readouterr().out
    # the same cached corpus under a lower limit: refused too, naming the count and the fix
    _raises(
        _spec(tmp_path, path, max_bad_rows=3),
        "4 rows have no 'text' value",
        "--data.max_bad_rows=4",
    )
