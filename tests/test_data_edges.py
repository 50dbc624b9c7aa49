"""Data intake at its edges: files that are not regular files or not text, labels of mixed
types, damaged caches, a run inside its own dataset, tensors stored twice in a checkpoint, and
resuming a checkpoint on data (or a base model) other than the one it was trained with. Each
case gives one message naming the value and the fix, or is handled and said."""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest

from shardwise.config import load_config
from shardwise.data import DataSpec, data_spec, load_data, prepare_data
from shardwise.data.corpus import resolve_source
from shardwise.errors import CheckpointError, ConfigError, DataError
from support.textdata import spec as _spec
from support.textdata import text as _text


def _refused(spec: DataSpec, *fragments: str) -> str:
    with pytest.raises(DataError) as info:
        prepare_data(spec)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert message.count("Fix:") == 1 and "\n" not in message, message
    return message


# --- entries that are not regular files -----------------------------------------------------


def test_a_fifo_in_a_dataset_directory_is_refused_without_being_opened(tmp_path: Path) -> None:
    """A FIFO named *.txt among the corpus files: opening it would block until something
    writes to it (a silent hang), so the scan names it from its stat alone. The preparation
    runs in a thread; if it blocks, the test writes nothing and closes the FIFO to free it."""
    root = tmp_path / "d"
    root.mkdir()
    (root / "a.txt").write_text(_text(0, 600))
    os.mkfifo(root / "pipe.txt")
    outcome: list[BaseException | None] = []

    def prepare() -> None:
        try:
            prepare_data(_spec(tmp_path, root))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=prepare, daemon=True)
    worker.start()
    worker.join(timeout=120)
    blocked = worker.is_alive()
    if blocked:  # free the reader: open the write end and close it (end of file)
        os.close(os.open(root / "pipe.txt", os.O_WRONLY))
        worker.join(timeout=60)
    assert not blocked, "preparing the data blocked on the FIFO"
    assert isinstance(outcome[0], DataError), outcome
    message = str(outcome[0])
    assert "pipe.txt' is a FIFO (named pipe), not a regular file" in message, message
    assert "Fix:" in message


def test_a_fifo_given_as_the_dataset_is_named_as_such(tmp_path: Path) -> None:
    """data.dataset pointing at a FIFO exists: 'does not exist' would send the user looking
    for a missing file."""
    fifo = tmp_path / "stream.txt"
    os.mkfifo(fifo)
    message = _refused(_spec(tmp_path, fifo), "is a FIFO (named pipe), not a regular file")
    assert "does not exist" not in message


def test_symlink_loops_and_dangling_symlinks_are_named(tmp_path: Path) -> None:
    """A symlink loop and a dangling symlink named *.txt in a dataset directory (a raw
    OSError traceback before), and a symlink loop given as the dataset itself."""
    root = tmp_path / "d"
    root.mkdir()
    (root / "a.txt").write_text(_text(0, 600))
    os.symlink("loop.txt", root / "loop.txt")
    os.symlink(tmp_path / "gone.txt", root / "gone.txt")
    message = _refused(_spec(tmp_path, root), "holds 2 data entries")
    assert "loop.txt' is a symlink loop" in message, message
    assert f"gone.txt' is a dangling symlink (to '{tmp_path / 'gone.txt'}'" in message, message
    _refused(_spec(tmp_path, root / "loop.txt"), "loop.txt' is a symlink loop")


# --- content that is not text ---------------------------------------------------------------


def test_a_sparse_file_of_nuls_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A sparse .txt of NUL bytes (binary data) was read whole, trained on and encoded
    without a word; its first block gives it away, so it is refused naming its size."""
    sparse = tmp_path / "zeros.txt"
    with open(sparse, "wb") as f:
        f.truncate(8 << 20)
    _refused(_spec(tmp_path, sparse), "zeros.txt' (8,388,608 bytes) holds binary data", "NUL")
    # NULs after the first block are found once the text is read
    late = tmp_path / "late.txt"
    late.write_text(_text(1, 20000) + "\0tail\n")
    _refused(_spec(tmp_path, late), "late.txt'", "holds binary data", "line 1667")


def test_a_lone_surrogate_is_named_by_file_and_line(tmp_path: Path) -> None:
    """A JSON escape of half a UTF-16 pair ("\\ud800") parses as JSON but is no UTF-8 text;
    the reader reported only 'Trailing data at position N'."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "fine"}\n{"text": "bad \\ud800 half"}\n')
    message = _refused(_spec(tmp_path, rows), "rows.jsonl'", "line 2 holds the lone surrogate")
    assert "\\ud800" in message and "not valid UTF-8" in message, message
    # the same half written as raw bytes in a .txt file
    raw = tmp_path / "raw.txt"
    raw.write_bytes(b"ok\n" + b"x\xed\xa0\x80y\n")
    _refused(_spec(tmp_path, raw), "raw.txt' is not UTF-8", "line 2", "a lone surrogate")


def _tokenizer_dir(root: Path) -> Path:
    """A tiny Hugging Face tokenizer folder (a BPE trained on WORDS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "[PAD]"])
    tok.train_from_iterator([_text(0, 600)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(root)
    return root


def test_mixed_label_types_are_refused_naming_the_values(tmp_path: Path) -> None:
    """Labels 1, "1", 2, "two", 1.0 in one JSON lines file were read as the strings 1, 1, 2,
    "two" (quotes included) and 1.0: four classes nobody meant. They are refused."""
    pytest.importorskip("transformers")
    rows = tmp_path / "labels.jsonl"
    labels = [1, "1", 2, "two", 1.0] * 4
    rows.write_text(
        "".join(json.dumps({"text": _text(i, 24), "label": y}) + "\n" for i, y in enumerate(labels))
    )
    spec = _spec(tmp_path, rows, label_field="label", tokenizer=str(_tokenizer_dir(tmp_path / "t")))
    message = _refused(spec, "data.label_field='label' mixes label types", "labels.jsonl'")
    for shown in ("1 (int)", '"1" (str)', "1.0 (float)"):
        assert shown in message, message


# --- caches ---------------------------------------------------------------------------------


def test_a_truncated_token_cache_is_rebuilt_and_said(tmp_path: Path, capsys) -> None:
    """`truncate -s 2000 cache/*/train.bin` left a run training on the 1,000 tokens that
    remained; the cache is checked against its meta.json and rebuilt, saying so."""
    corpus = tmp_path / "one.txt"
    corpus.write_text(_text(0, 6000))
    spec = _spec(tmp_path, corpus)
    whole = len(load_data(spec, "train").tokens)
    (train_bin,) = (tmp_path / "cache").glob("*/train.bin")
    os.truncate(train_bin, 2000)
    capsys.readouterr()
    again = load_data(spec, "train")
    err = capsys.readouterr().err
    assert "is damaged (train.bin holds 2,000 bytes" in err and "rebuilding it" in err, err
    assert len(again.tokens) == whole > 1000


def test_a_truncated_record_cache_is_rebuilt_and_said(tmp_path: Path, capsys) -> None:
    """The same for the encoded-record caches (classification, instruction, chat): sizes are
    recorded in meta.json when built and checked on every use."""
    from shardwise.data.cache import build_once, save_array

    def build(root: Path) -> dict:
        save_array(root / "train.ids.npy", np.arange(1000, dtype=np.int64))
        return {"rows": 1000}

    root = tmp_path / "records"
    meta = build_once(root, build)
    assert meta["sizes"]["train.ids.npy"] == (root / "train.ids.npy").stat().st_size
    os.truncate(root / "train.ids.npy", 200)
    capsys.readouterr()
    build_once(root, build)
    assert "train.ids.npy holds 200 bytes" in capsys.readouterr().err
    assert np.load(root / "train.ids.npy").shape == (1000,)


def test_the_run_inside_its_dataset_is_not_read_as_data(tmp_path: Path, monkeypatch) -> None:
    """`--data.dataset=.` with the run directory inside it: the second run read the first
    run's metrics.jsonl and checkpoint index.json as data. The run's outputs (run.dir,
    checkpoint.dir, the cache) are left out of the scan."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(_text(0, 600))
    for written in (
        "runs/r1/metrics.jsonl",
        "runs/r1/checkpoints/step-00000002/index.json",
        "ckpt/step-00000002/index.json",
        "cache/x/meta.json",
    ):
        (tmp_path / written).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / written).write_text("{}\n")
    cfg = load_config(
        None,
        [
            "--data.dataset=.",
            "--run.dir=runs/r1",
            "--checkpoint.dir=ckpt",
            "--data.cache_dir=cache",
        ],
    )
    files = resolve_source(data_spec(cfg, 512)).files
    assert [f.name for f in files] == ["corpus.txt"]
    # a glob over the folder leaves them out too
    cfg = load_config(
        None,
        [
            "--data.dataset=**/*.json*",
            "--run.dir=runs/r1",
            "--checkpoint.dir=ckpt",
            "--data.cache_dir=cache",
        ],
    )
    with pytest.raises(DataError, match="matches no files"):
        resolve_source(data_spec(cfg, 512))


# --- checkpoints of Hugging Face weights ------------------------------------------------------


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path: Path) -> None:
    """Two safetensors shards both holding 'w': the index picks one, transformers may load the
    other, and the run silently depended on which. Refused naming the tensor and both files."""
    import torch
    from safetensors.torch import save_file

    from shardwise.models.hf.weights import INDEX, weight_files

    save_file(
        {"w": torch.zeros(2), "a": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors"
    )
    save_file({"w": torch.ones(2)}, tmp_path / "model-00002-of-00002.safetensors")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "w": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ConfigError) as info:
        weight_files(tmp_path)
    message = str(info.value)
    assert (
        "tensor 'w' is stored twice, in model-00001-of-00002.safetensors and "
        "model-00002-of-00002.safetensors" in message
    ), message
    assert "Fix:" in message


# --- resuming on other data or another base ---------------------------------------------------

OTHER = ["alpha", "omega", "quartz", "violet", "ember", "harbor", "lantern", "meadow", "cobalt"]


def _run(tmp_path: Path, *overrides: str, steps: int) -> dict:
    from shardwise.launchers.harness import run_here
    from support.compare import case

    return run_here(
        case(
            f"--train.steps={steps}",
            "--checkpoint.every=2",
            "--data.val_fraction=0",
            f"--data.cache_dir={tmp_path / 'cache'}",
            *overrides,
        ),
        str(tmp_path / "run"),
    )


def test_resuming_on_other_data_or_a_grown_file_is_refused(tmp_path: Path) -> None:
    """A checkpoint trained on a.txt, resumed on another dataset or on a.txt with one line
    appended: a new BPE was trained on that data and the old weights continued with it
    (thousands of ids meaning other tokens). The checkpoint records the data and its
    tokenizer's vocabulary; a resume with another vocabulary is refused in one message
    naming both and the fix. The same text rewritten (a new mtime, the same vocabulary)
    resumes."""
    corpus, other = tmp_path / "a.txt", tmp_path / "b.txt"
    original = _text(0, 6000)
    corpus.write_text(original)
    rng = random.Random(1)
    other.write_text("\n".join(" ".join(rng.choices(OTHER, k=12)) for _ in range(500)) + "\n")
    _run(tmp_path, f"--data.dataset={corpus}", steps=2)
    with pytest.raises(CheckpointError) as info:
        _run(tmp_path, f"--data.dataset={other}", steps=4)
    message = str(info.value)
    for needle in (f"data.dataset='{corpus}'", f"data.dataset='{other}'", "vocabulary differs"):
        assert needle in message, message
    assert "Fix: resume on the data it was trained on" in message
    assert "--run.dir=<another directory>" in message, message
    with open(corpus, "a") as f:
        f.write("zyxw vuts " * 400 + "\n")
    with pytest.raises(CheckpointError, match=r"a\.txt' \(1 file, \d[\d,]* bytes\)"):
        _run(tmp_path, f"--data.dataset={corpus}", steps=4)
    corpus.write_text(original)
    assert _run(tmp_path, f"--data.dataset={corpus}", steps=4)["resume_note"] is None


def _llama(path: Path, seed: int) -> None:
    """A tiny random Llama checkpoint whose shape fits the test's decoder preset."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def test_qlora_refuses_to_resume_or_export_on_a_changed_base(tmp_path: Path) -> None:
    """QLoRA stores only the adapters; the NF4 base is re-read from model.init_from on resume
    and on export. Another model saved in its place (same shapes, other values) was paired
    with the adapters silently; now the checkpoint records the base's files (sizes and sampled
    contents) and both refuse, naming the folder and the fix. The original weights saved
    again (a new mtime, the same bytes) resume and export."""
    pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    from shardwise.checkpoint.export import export_hf

    base = tmp_path / "base"
    _llama(base, seed=0)
    corpus = tmp_path / "a.txt"
    corpus.write_text(_text(0, 6000))
    qlora = [
        f"--model.init_from={base}",
        "--data.tokenizer=bpe",
        f"--data.dataset={corpus}",
        "--finetune.lora_rank=4",
        "--finetune.lora_alpha=8",
        "--finetune.base_quant=nf4",
    ]
    _run(tmp_path, *qlora, steps=2)
    _llama(base, seed=1)  # a different model of the same shapes
    fragments = (f"model.init_from='{base}'", "changed since (model.safetensors)", "Fix:")
    with pytest.raises(CheckpointError) as info:
        _run(tmp_path, *qlora, steps=4)
    assert all(f in str(info.value) for f in fragments), info.value
    with pytest.raises(CheckpointError) as info:
        export_hf(tmp_path / "run", tmp_path / "merged")
    assert all(f in str(info.value) for f in fragments), info.value
    assert not (tmp_path / "merged").exists()
    _llama(base, seed=0)
    assert _run(tmp_path, *qlora, steps=4)["losses"]
    export_hf(tmp_path / "run", tmp_path / "merged")
    assert (tmp_path / "merged" / "model.safetensors").is_file()


def test_other_data_with_the_same_tokenizer_is_noted_and_other_labels_refused() -> None:
    """Continuing on other data through the same tokenizer (a pretrained one) keeps every id's
    meaning: the resume goes on and says what changed. Other labels (a classifier's outputs
    in another order or number) are refused like another vocabulary."""
    from shardwise.data.identity import compare_data

    tok = {"what": "the tokenizer of ckpt", "key": "k1"}
    saved = {"dataset": "a.jsonl", "files": 1, "bytes": 100, "content": "c1", "tokenizer": tok}
    grown = {**saved, "bytes": 180, "content": "c2"}
    refusal, note = compare_data(saved, grown, "ckpt/step-00000002")
    assert refusal is None and "the data changed since that checkpoint" in note, note
    assert "100 bytes" in note and "180 bytes" in note, note
    assert compare_data(saved, dict(saved), "p") == (None, None)
    assert compare_data(None, saved, "p") == (None, None)  # saved before identities existed
    refusal, _ = compare_data({**saved, "labels": ["neg", "pos"]}, {**saved, "labels": ["a"]}, "p")
    assert "the labels ['neg', 'pos']" in refusal and "['a']" in refusal, refusal
    assert refusal.count("Fix:") == 1


# --- through the command line: one line, no traceback, no hang ---------------------------------


@pytest.fixture
def odd(tmp_path: Path) -> Path:
    """A folder of data entries that are not text files."""
    (tmp_path / "fifo_dir").mkdir()
    (tmp_path / "fifo_dir" / "a.txt").write_text(_text(0, 600))
    os.mkfifo(tmp_path / "fifo_dir" / "b.txt")
    os.mkfifo(tmp_path / "fifo.txt")
    os.symlink("loop.txt", tmp_path / "loop.txt")
    with open(tmp_path / "zeros.txt", "wb") as f:
        f.truncate(8 << 20)
    (tmp_path / "half.jsonl").write_text('{"text": "ok"}\n{"text": "x \\udc00"}\n')
    return tmp_path


@pytest.mark.parametrize(
    ("dataset", "needle"),
    [
        ("fifo_dir", "b.txt' is a FIFO (named pipe), not a regular file"),
        ("fifo.txt", "fifo.txt' is a FIFO (named pipe), not a regular file"),
        ("loop.txt", "loop.txt' is a symlink loop"),
        ("zeros.txt", "holds binary data, not text: a NUL byte at character 0"),
        ("half.jsonl", "line 2 holds the lone surrogate \\udc00"),
    ],
)
def test_the_cli_names_each_entry_in_one_line(odd: Path, dataset: str, needle: str, capsys):
    """`shardwise train` on each of these prints one error line with the value and the fix
    and exits 2 (before: a hang, 'does not exist', a traceback or 'Trailing data')."""
    from test_bad_input import SAFE_TRAIN, check, run_main

    argv = ["train", "--nproc", "1", f"--data.dataset={odd / dataset}", *SAFE_TRAIN]
    code, err = run_main([*argv, f"--data.cache_dir={odd / 'cache'}"], capsys)
    check(code, err, [needle])
