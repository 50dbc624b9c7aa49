"""`shardwise data prepare` and `data.blend`: the manifest, the prepared token stream against the
token cache training builds, resuming after a kill, blend proportions, and every refusal."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.cli.main import main
from shardwise.config import load_config
from shardwise.data import GlobalSampler, data_spec, load_data
from shardwise.data.blend import BlendDataset, locate
from shardwise.data.identity import vocab_key
from shardwise.data.prepare import Options, prepare
from shardwise.data.shards import PARTIAL
from shardwise.data.tokens import load_tokens
from shardwise.errors import ConfigError, DataError
from shardwise.launchers.harness import run_here
from support.compare import VOCAB, case
from support.textdata import spec as _spec
from support.textdata import text as _text

SMALL_SHARDS = 0.004  # MB of text per shard: ~8 shards of the corpora below


def _corpus(root: Path, seed: int = 0, docs: int = 24) -> Path:
    """`docs` .txt documents and a .jsonl of more, all of WORDS, in `root`."""
    root.mkdir(parents=True)
    for i in range(docs):
        (root / f"d{i:02d}.txt").write_text(_text(seed * 1000 + i, 300))
    rows = [{"text": _text(seed * 1000 + 500 + i, 120)} for i in range(10)]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _prepare(inputs, out: Path, **kw) -> dict:
    kw = {"vocab_size": VOCAB, "shard_mb": SMALL_SHARDS, "workers": 1, **kw}
    return prepare(Options(inputs=tuple(str(i) for i in inputs), out=str(out), **kw))


def _stream(out: Path, manifest: dict, split: str) -> np.ndarray:
    shards = manifest["splits"][split]["shards"]
    return np.concatenate([np.fromfile(out / s["name"], dtype=manifest["dtype"]) for s in shards])


def _hf_tokenizer(root: Path) -> Path:
    """A Hugging Face tokenizer folder: a byte-level BPE with an end-of-text token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_text(7, 600)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _corpus(tmp_path_factory.mktemp("c") / "corpus")


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("p") / "prepared"
    return out, _prepare([corpus], out, workers=2)


def test_manifest_records_tokenizer_shards_and_checksums(prepared, corpus):
    """The manifest is what a reader needs to trust the shards: each shard's sha256 and
    token count match its file, the tokenizer (kind, size, eos id, vocabulary hash of the
    tokenizer.json beside it) and dtype are recorded, as are the inputs and the split."""
    out, m = prepared
    assert m["kind"] == "shardwise-prepared" and m["dtype"] == "uint16"
    assert m["inputs"] == [str(corpus)] and m["val_fraction"] == 0.02
    tok = m["tokenizer"]
    assert tok["kind"] == "bpe" and tok["vocab_size"] <= VOCAB and m["eos_id"] == tok["eos_id"]
    assert tok["vocab_key"] == vocab_key(out / "tokenizer.json")
    assert len(m["splits"]["train"]["shards"]) > 2 and m["splits"]["val"]["shards"]
    assert m["splits"]["train"]["docs"] + m["splits"]["val"]["docs"] == 24 + 10
    for split in ("train", "val"):
        shards = m["splits"][split]["shards"]
        for s in shards:
            data = (out / s["name"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == s["sha256"]
            assert len(data) == 2 * s["tokens"]
        assert m["splits"][split]["tokens"] == sum(s["tokens"] for s in shards)
    assert not (out / PARTIAL).exists()
    assert json.loads((out / "manifest.json").read_text()) == m


def test_prepared_stream_equals_the_token_cache(prepared, corpus, tmp_path):
    """Training on a prepared directory must be training on the raw corpus: its train and val
    shards concatenated equal, token for token, the arrays the token cache builds (same
    documents, order, end-of-text tokens, held-out split, BPE), and every window, including
    those across shard boundaries, is the same sample."""
    out, m = prepared
    spec = _spec(tmp_path, corpus, vocab_size=VOCAB, seq_len=32)
    for split in ("train", "val"):
        raw = load_tokens(spec, split)
        assert np.array_equal(_stream(out, m, split), np.asarray(raw.tokens))
        mine = load_data(_spec(tmp_path, out, vocab_size=VOCAB, seq_len=32), split)
        assert len(mine) == len(raw) > 0
        every = torch.arange(len(raw))
        for a, b in zip(mine.get_batch(every), raw.get_batch(every), strict=True):
            assert torch.equal(a, b)
        for data, bad in ((mine, len(raw)), (raw, len(raw)), (mine, -1)):  # no silent wrap
            with pytest.raises(IndexError, match=rf"out of range \[0, {len(raw)}\)"):
                data.get_batch(torch.tensor([0, bad]))


def test_a_hf_tokenizer_and_a_saved_dataset_give_the_cache_s_stream(corpus, tmp_path):
    """With --tokenizer DIR the shards equal the cache built with data.tokenizer=DIR; a folder
    `Dataset.save_to_disk` wrote is read row by row, every non-empty row one document."""
    import datasets

    tok = _hf_tokenizer(tmp_path / "tok")
    m = _prepare([corpus], tmp_path / "out", tokenizer=str(tok), workers=2)
    raw = load_tokens(_spec(tmp_path, corpus, tokenizer=str(tok), vocab_size=VOCAB), "train")
    assert np.array_equal(_stream(tmp_path / "out", m, "train"), np.asarray(raw.tokens))
    rows = [_text(i, 60) for i in range(12)] + [""]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "saved"))
    m = _prepare([tmp_path / "saved"], tmp_path / "out2", tokenizer=str(tok))
    assert m["splits"]["train"]["docs"] + m["splits"]["val"]["docs"] == 12


def test_a_short_run_has_the_losses_of_the_raw_corpus(prepared, corpus, tmp_path):
    """Three steps of one process on the prepared directory and on the raw corpus (its own
    cache, the same BPE size and held-out fraction) give equal losses."""
    out, _ = prepared
    common = ["--train.steps=3", "--model.n_layers=1", f"--data.cache_dir={tmp_path / 'cache'}"]
    raw = run_here(case(*common, f"--data.dataset={corpus}"), str(tmp_path / "raw"))
    mine = run_here(case(*common, f"--data.dataset={out}"), str(tmp_path / "mine"))
    assert len(raw["losses"]) == 3
    assert mine["losses"] == raw["losses"]


def test_a_rerun_after_a_kill_keeps_finished_shards(corpus, tmp_path, capsys):
    """A prepare stopped after its first recorded shard (two workers, others in flight) is
    finished by rerunning it: recorded shards are kept untouched (same inode and mtime), a
    temporary file the kill left is removed, and the result equals an uninterrupted run."""
    out = tmp_path / "out"

    def stop(name: str) -> None:
        raise KeyboardInterrupt(f"killed after {name}")

    with pytest.raises(KeyboardInterrupt):
        prepare(Options((str(corpus),), str(out), vocab_size=VOCAB, shard_mb=SMALL_SHARDS,
                        workers=2), on_shard=stop)  # fmt: skip
    partial = json.loads((out / PARTIAL).read_text())
    done = sorted(partial["done"])
    assert done and len(done) < len(partial["plan"]) and not (out / "manifest.json").exists()
    (out / "train-00005.bin.tmp999").write_bytes(b"half")  # what a killed worker leaves
    before = {n: ((out / n).stat().st_ino, (out / n).stat().st_mtime_ns) for n in done}
    capsys.readouterr()
    m = _prepare([corpus], out, workers=2)
    assert f"kept {len(done)} of {len(partial['plan'])} shards" in capsys.readouterr().err
    after = {n: ((out / n).stat().st_ino, (out / n).stat().st_mtime_ns) for n in done}
    assert after == before
    assert not list(out.glob("*.tmp*")) and not (out / PARTIAL).exists()
    whole = _prepare([corpus], tmp_path / "whole", workers=1)
    assert m["splits"] == whole["splits"] and m["tokenizer"] == whole["tokenizer"]
    capsys.readouterr()
    assert _prepare([corpus], out)["splits"] == m["splits"]  # finished: nothing redone
    assert "already prepared" in capsys.readouterr().err


def _sorted_blend(weights: list[float], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The blend's definition, done the long way: every source's draws j at times
    (j + 1/2) / w, all sorted by time (ties: the earlier source), the first n kept."""
    k = len(weights)
    src, draw, time = [], [], []
    for s, w in enumerate(weights):
        j = np.arange(int(w * n) + k + 2, dtype=np.int64)
        src.append(np.full(len(j), s, dtype=np.int64))
        draw.append(j)
        time.append((j + 0.5) / w)
    src, draw, time = (np.concatenate(a) for a in (src, draw, time))
    first = np.lexsort((src, time))[:n]
    return src[first], draw[first]


@pytest.mark.parametrize(
    "weights", [[0.7, 0.3], [1 / 3] * 3, [0.5, 0.25, 0.125, 0.125], [0.999, 0.001]]
)
def test_a_sample_is_located_without_building_the_epoch(weights):
    """Blend sample i's source and draw are computed for i alone, and equal the definition's
    (every draw sorted by time over a whole epoch), ties between sources included."""
    want = _sorted_blend(weights, 20_000)
    got = locate(weights, np.arange(20_000))
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    far = np.array([10**9, 10**9 + 7])  # an epoch of 10^9 samples costs nothing to index
    s, d = locate(weights, far)
    assert ((s >= 0) & (s < len(weights))).all() and (d >= 0).all()


def test_a_blend_draws_each_source_by_its_weight(tmp_path):
    """Over 10,000 samples drawn by the global sampler, each source's share is within 1 % of
    its normalised weight; every row is its source's sample; the map from sample to (source,
    index) is a pure function of the index (the same when built again, so a blend resumes
    mid-epoch), and a longer blend extends a shorter one."""
    tok = _hf_tokenizer(tmp_path / "tok")
    a = _prepare([_corpus(tmp_path / "a", seed=1)], tmp_path / "pa", tokenizer=str(tok))
    b = _prepare([_corpus(tmp_path / "b", seed=2, docs=8)], tmp_path / "pb", tokenizer=str(tok))
    assert a["splits"]["train"]["tokens"] > 2 * b["splits"]["train"]["tokens"]
    spec = _spec(tmp_path, "stdlib", blend=f"{tmp_path / 'pa'}:7,{tmp_path / 'pb'}:3")
    blend = load_data(spec, "train")
    assert isinstance(blend, BlendDataset)
    idx = torch.cat([GlobalSampler(len(blend), 100, 0).global_indices(s) for s in range(100)])
    which, inner = blend.where(idx.numpy())
    share = np.bincount(which, minlength=2) / len(idx)
    assert abs(share[0] - 0.7) < 0.01 and abs(share[1] - 0.3) < 0.01, share
    x, y = blend.get_batch(idx[:64])
    for row in range(64):
        sx, sy = blend.sources[which[row]].get_batch(torch.tensor([inner[row]]))
        assert torch.equal(x[row], sx[0]) and torch.equal(y[row], sy[0])
    with pytest.raises(IndexError, match=rf"out of range \[0, {len(blend)}\)"):
        blend.get_batch(torch.tensor([len(blend)]))
    again = load_data(spec, "train").where(idx.numpy())
    assert np.array_equal(again[0], which) and np.array_equal(again[1], inner)
    s_short, d_short = locate([0.7, 0.3], np.arange(1000))
    s_long, d_long = locate([0.7, 0.3], np.arange(10_000))
    assert np.array_equal(s_long[:1000], s_short) and np.array_equal(d_long[:1000], d_short)
    assert abs(np.bincount(s_long)[0] - 7000) <= 2


def test_a_blend_table_in_the_config_file_is_the_string_form(tmp_path):
    """`[data.blend]` with `"PATH" = WEIGHT` lines gives the BlendDataset the string form
    gives: the same sources, weights and samples. A malformed table, and a table for any other
    string key, are refused by name."""
    tok = _hf_tokenizer(tmp_path / "tok")
    for name, seed, docs in (("pa", 1, 6), ("pb", 2, 4)):
        _prepare([_corpus(tmp_path / name[1], seed=seed, docs=docs)], tmp_path / name,
                 tokenizer=str(tok))  # fmt: skip
    a, b = tmp_path / "pa", tmp_path / "pb"
    toml = tmp_path / "blend.toml"
    toml.write_text(f'[data]\nseq_len = 16\n[data.blend]\n"{a}" = 0.7\n"{b}" = 3\n')
    table = load_config(toml)
    string = load_config(None, ["--data.seq_len=16", f"--data.blend={a}:0.7,{b}:3"])
    assert table.data.blend == string.data.blend
    mine, theirs = (load_data(data_spec(c, VOCAB), "train") for c in (table, string))
    assert isinstance(mine, BlendDataset) and isinstance(theirs, BlendDataset)
    assert [Path(s.path) for s in mine.sources] == [Path(s.path) for s in theirs.sources]
    assert [Path(s.path) for s in mine.sources] == [a, b]
    assert mine.weights == theirs.weights == pytest.approx([0.7 / 3.7, 3 / 3.7])
    every = torch.arange(len(theirs))
    assert len(mine) == len(theirs)
    for x, y in zip(mine.get_batch(every), theirs.get_batch(every), strict=True):
        assert torch.equal(x, y)
    for body, match in (
        (f'[data.blend]\n"{a}" = "high"\n', "weight 'high' of .* is not a number"),
        ("[data.blend]\n", "empty table"),
        (f'[data.blend]\n"{a},{b}" = 1\n', "holds a comma"),
        (f'[data.dataset]\n"{a}" = 1\n', "data.dataset=.* is a table"),
    ):
        toml.write_text(body)
        with pytest.raises(ConfigError, match=match) as info:
            load_config(toml)
        assert "Fix:" in str(info.value) and "\n" not in str(info.value)


def test_a_streamed_hf_dataset_is_an_input(tmp_path, monkeypatch, capsys):
    """`hf:json:data_files=GLOB` streams the rows through datasets.load_dataset (no Arrow copy
    of the data is written to its cache): the shards equal those of the same texts, in the
    same order, from a saved Dataset; a null or missing text is skipped and counted. The
    command line takes it; a changed file, a bad option, a glob matching nothing and a
    missing column are refused by name."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rows = tmp_path / "rows"
    rows.mkdir()
    texts = []
    for f in range(3):
        lines = [{"text": _text(100 * f + i, 60), "n": i} for i in range(5)]
        lines += [{"text": None, "n": 5}, {"n": 6}]  # skipped: no text
        texts += [r["text"] for r in lines[:5]]
        (rows / f"part{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    stream = f"hf:json:data_files={rows}/*.jsonl"
    m = _prepare([stream], tmp_path / "out", val_fraction=0.0)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    ref = _prepare([tmp_path / "saved"], tmp_path / "ref", val_fraction=0.0)
    assert m["splits"]["train"]["docs"] == len(texts) == 15 and m["skipped_rows"][0] == 6
    assert np.array_equal(
        _stream(tmp_path / "out", m, "train"), _stream(tmp_path / "ref", ref, "train")
    )
    assert not list((tmp_path / "hf-cache").rglob("*.arrow"))  # streamed, never materialised
    argv = ["data", "prepare", f"{stream},split=train", "--out", str(tmp_path / "cli")]
    assert main([*argv, "--vocab-size", str(VOCAB), "--workers", "1"]) == 0
    (rows / "part1.jsonl").write_text(json.dumps({"text": "changed"}) + "\n")
    _refused("part1.jsonl' changed", _prepare, [stream], tmp_path / "out", val_fraction=0.0)
    for raw, match in (
        (f"{stream},shuffle=yes", "'shuffle=yes' is not OPTION=VALUE"),
        (f"hf:json:data_files={tmp_path}/none/*.jsonl", "matches no file"),
        ("hf:", "names no dataset"),
    ):
        _refused(match, _prepare, [raw], tmp_path / "bad")
    _refused(r"--text-field 'body' is not a column .*\['text', 'n'\]", _prepare, [stream],
             tmp_path / "bad", text_field="body")  # fmt: skip


def _refused(match: str, fn, *args, **kw) -> str:
    with pytest.raises(DataError, match=match) as info:
        fn(*args, **kw)
    message = str(info.value)
    assert "\n" not in message and "Fix:" in message, message
    return message


def test_prepare_refusals_name_the_value_and_the_fix(corpus, tmp_path, capsys):
    """Each refusal is one line naming the value and the fix: an empty input, an output
    holding others' files (left untouched), and a rerun with another tokenizer or other
    inputs than the unfinished prepare it would continue."""
    (tmp_path / "empty.txt").write_text("")
    _refused(
        "INPUT '.*empty.txt' holds no text", _prepare, [tmp_path / "empty.txt"], tmp_path / "o"
    )
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    _refused("did not write .*'notes.txt'", _prepare, [corpus], theirs)
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]
    assert (theirs / "notes.txt").read_text() == "mine"
    # the command line says it in one line and exits 2
    assert main(["data", "prepare", str(corpus), "--out", str(theirs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out") and "Fix:" in err[0]
    # an unfinished prepare, then reruns that would mix two tokenizers or two corpora
    out, copy = tmp_path / "out", tmp_path / "copy"
    copy.mkdir()
    for f in corpus.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())

    def stop(name: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(Options((str(copy),), str(out), vocab_size=VOCAB, shard_mb=SMALL_SHARDS,
                        workers=1), on_shard=stop)  # fmt: skip
    _refused("the trained BPE of --vocab-size 400 differs from the unfinished prepare .*Fix: "
             "rerun with the trained BPE of --vocab-size 512", _prepare, [copy], out,
             vocab_size=400)  # fmt: skip
    _refused("--val-fraction 0.1 differs .*Fix: rerun with --val-fraction 0.02", _prepare,
             [copy], out, val_fraction=0.1)  # fmt: skip
    (copy / "d03.txt").write_text("changed")
    _refused(r"the inputs .* differ .*d03.txt' changed\)", _prepare, [copy], out)


def test_training_and_blend_refusals_name_the_value_and_the_fix(prepared, corpus, tmp_path):
    """Training on a prepared directory with another held-out fraction, and blends with a bad
    weight, a missing directory, sources of two vocabularies or data.dataset also set, are
    refused in one line with the fix."""
    out, _ = prepared
    spec = _spec(tmp_path, out, vocab_size=VOCAB, val_fraction=0.05)
    _refused(r"data.val_fraction=0.05 but .* --val-fraction 0.02", load_data, spec, "train")
    for blend, match in (
        (f"{out}:0", "weight '0' of .* must be a number > 0"),
        (f"{out}:x", "weight 'x'"),
        (f"{out}", "is not PATH:WEIGHT"),
    ):
        _refused(match, load_data, _spec(tmp_path, "stdlib", blend=blend), "train")
    spec = _spec(tmp_path, corpus, blend=f"{out}:1")
    _refused("both name the training data", load_data, spec, "train")
    spec = _spec(tmp_path, "stdlib", vocab_size=VOCAB, blend=f"{out}:1,{tmp_path / 'no'}:1")
    _refused("source '.*no' does not exist", load_data, spec, "train")
    other = _prepare([_corpus(tmp_path / "other", seed=5)], tmp_path / "other_p")
    assert (
        other["tokenizer"]["vocab_key"]
        != json.loads((out / "manifest.json").read_text())["tokenizer"]["vocab_key"]
    )
    spec = _spec(tmp_path, "stdlib", vocab_size=VOCAB, blend=f"{out}:1,{tmp_path / 'other_p'}:1")
    _refused("another tokenizer or vocabulary", load_data, spec, "train")


def test_a_tokenizer_saved_with_truncation_still_keeps_whole_documents(corpus, tmp_path):
    """A tokenizer saved for a classifier truncates and pads (all-MiniLM's: 128 tokens). A
    corpus is documents, not model inputs: both the prepared shards and the token cache hold
    every document whole, the same ids as the tokenizer without truncation gives."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    plain = _hf_tokenizer(tmp_path / "plain")
    backend = Tokenizer.from_file(str(plain / "tokenizer.json"))
    backend.enable_truncation(16)
    backend.enable_padding(length=16)
    cut = tmp_path / "cut"
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(
        cut
    )
    m = _prepare([corpus], tmp_path / "out", tokenizer=str(cut))
    whole = _prepare([corpus], tmp_path / "whole", tokenizer=str(plain))
    got = _stream(tmp_path / "out", m, "train")
    assert len(got) > 16 * (m["splits"]["train"]["docs"] + 1)  # not cut to 16 per document
    assert np.array_equal(got, _stream(tmp_path / "whole", whole, "train"))
    raw = load_tokens(_spec(tmp_path, corpus, tokenizer=str(cut), vocab_size=VOCAB), "train")
    assert np.array_equal(got, np.asarray(raw.tokens))


def test_inputs_in_another_order_and_a_vocab_size_beside_a_tokenizer_are_refused(
    corpus, tmp_path, capsys
):
    """The held-out split follows the order of the inputs, so a rerun naming them in another
    order is refused by name; --vocab-size sizes a trained BPE and is refused beside
    --tokenizer rather than ignored."""
    other = tmp_path / "other.txt"
    other.write_text(_text(99, 200))
    out = tmp_path / "out"
    _prepare([corpus, other], out)
    _refused("the same files in another order", _prepare, [other, corpus], out)
    tok = _hf_tokenizer(tmp_path / "tok")
    argv = ["data", "prepare", str(corpus), "--out", str(tmp_path / "o2")]
    capsys.readouterr()  # (the prepares' progress above)
    assert main([*argv, "--tokenizer", str(tok), "--vocab-size", "512"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--vocab-size 512" in err[0] and "Fix: drop --vocab-size" in err[0]


def test_a_prepare_sigkilled_half_way_keeps_its_finished_shards(tmp_path):
    """The real thing: `shardwise data prepare` in its own process, SIGKILLed once half of its
    shards are recorded (workers and all, as an OOM killer or a lost node would), then run
    again. The rerun keeps every shard recorded before the kill (same inode and mtime), redoes
    only the rest, and ends with the manifest of an uninterrupted prepare."""
    import os
    import signal
    import subprocess
    import sys
    import time

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(192):  # ~190 shards: about a second of shard work after start-up
        (corpus / f"d{i:03d}.txt").write_text(_text(7000 + i, 2500))
    tok = _hf_tokenizer(tmp_path / "tok")
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-c",
        "import sys; from shardwise.cli.main import main; sys.exit(main())",
    ]
    argv += ["data", "prepare", str(corpus), "--out", str(out), "--tokenizer", str(tok)]
    argv += ["--shard-mb", "0.01", "--workers", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    half, deadline = None, time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            partial = json.loads((out / PARTIAL).read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or mid-rename
            time.sleep(0.005)
            continue
        if partial["plan"] and len(partial["done"]) * 2 >= len(partial["plan"]):
            os.killpg(proc.pid, signal.SIGKILL)  # the prepare and its workers at once
            half = partial
            break
        time.sleep(0.005)
    proc.wait(timeout=60)
    if half is None:
        pytest.fail("the prepare finished (or hung) before half of its shards were recorded")
    partial = json.loads((out / PARTIAL).read_text())  # what the killed run left on disk
    done = sorted(partial["done"])
    assert len(partial["plan"]) > len(done) >= len(half["done"]) > 0
    before = {n: ((out / n).stat().st_ino, (out / n).stat().st_mtime_ns) for n in done}
    m = _prepare([corpus], out, tokenizer=str(tok), shard_mb=0.01, workers=2)
    after = {n: ((out / n).stat().st_ino, (out / n).stat().st_mtime_ns) for n in done}
    assert after == before and not list(out.glob("*.tmp*")) and not (out / PARTIAL).exists()
    whole = _prepare([corpus], tmp_path / "whole", tokenizer=str(tok), shard_mb=0.01, workers=2)
    assert m["splits"] == whole["splits"]
