"""A model from a checkpoint reads its text through the checkpoint's own tokenizer:
the ids fed to the model decode back to the source documents, the token cache is
keyed by the tokenizer's content, and a tokenizer the model cannot embed, or a checkpoint
without one, is one clear error before any process starts."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.config import load_config  # noqa: E402
from shardwise.data import load_data, prepare_data  # noqa: E402
from shardwise.errors import DataError  # noqa: E402
from shardwise.training.runtime import data_spec  # noqa: E402
from shardwise.training.validate import derive  # noqa: E402

SEQ = 32


def _documents() -> list[str]:
    """Real text: the docstrings of a few standard-library modules (ASCII, so a window cut
    anywhere decodes to the same characters)."""
    import collections
    import csv
    import json as json_mod
    import pathlib
    import textwrap

    docs = []
    for mod in (collections, csv, json_mod, pathlib, textwrap):
        for _, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc and doc.isascii() and len(doc) > 80 and doc not in docs:
                docs.append(doc)
    return docs[:60]


def _tokenizer(vocab: int, docs: list[str]):
    """A byte-level BPE trained here, wrapped as a Llama-like transformers tokenizer: <s> at
    the start of every sequence (its post-processor), </s> as end of sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )


def _checkpoint(out: Path, tokenizer, vocab_size: int) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    docs = _documents()
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = _tokenizer(320, docs)
    return {
        "root": root,
        "docs": docs,
        "data": data,
        "tok": tok,
        "ckpt": _checkpoint(root / "llama", tok, len(tok)),
        "cache": root / "cache",
    }


def _overrides(world, ckpt: Path, *extra: str) -> list[str]:
    return [
        "--model.name=tiny",
        f"--model.init_from={ckpt}",
        f"--data.dataset={world['data']}",
        f"--data.seq_len={SEQ}",
        "--data.val_fraction=0.1",
        f"--data.cache_dir={world['cache']}",
        *extra,
    ]


def _spec(world, ckpt: Path, *extra: str):
    cfg = load_config(None, _overrides(world, ckpt, *extra))
    return data_spec(cfg, derive(cfg, 1).spec.vocab_size)


def test_the_ids_fed_to_the_model_are_the_checkpoints_tokenizer(world):
    spec = _spec(world, world["ckpt"])
    assert spec.tokenizer == str(world["ckpt"])
    data = load_data(spec, "train")
    tok = transformers.AutoTokenizer.from_pretrained(world["ckpt"])
    # every packed document: <s> + the tokenizer's ids of one source document + </s>
    ids = [int(i) for i in data.tokens]
    pieces = tok.decode(ids).split("</s>")
    assert pieces[-1] == "" and all(p.startswith("<s>") for p in pieces[:-1])
    decoded = [p[len("<s>") :] for p in pieces[:-1]]
    assert set(decoded) <= set(world["docs"]) and len(decoded) >= len(world["docs"]) * 0.8
    # and the ids are exactly the tokenizer's encoding of those documents, in stored order
    again = [i for text in decoded for i in [*tok(text)["input_ids"], tok.eos_token_id]]
    assert again == ids
    # a batch as the model gets it: inputs decode to a stretch of those documents
    x, y = data.get_batch(torch.tensor([0, 3]))
    assert x.shape == (2, SEQ) and torch.equal(x[:, 1:], y[:, :-1])
    stream = tok.decode(ids)
    for row in x:
        assert tok.decode(row.tolist()) in stream
    assert data.vocab_size == len(tok)


def test_the_cache_is_keyed_by_the_tokenizers_content(world):
    first = _spec(world, world["ckpt"])
    prepare_data(first)
    copy = shutil.copytree(world["ckpt"], world["root"] / "llama-copy")
    other = _tokenizer(300, world["docs"])
    different = _checkpoint(world["root"] / "llama-300", other, len(other))
    prepare_data(_spec(world, copy))
    prepare_data(_spec(world, different))
    dirs = sorted(p.name for p in world["cache"].iterdir() if (p / "meta.json").exists())
    # the copied tokenizer finds the first cache, the other tokenizer builds its own
    assert len(dirs) == 2, dirs
    metas = [json.loads((world["cache"] / d / "meta.json").read_text()) for d in dirs]
    assert sorted(m["vocab_size"] for m in metas) == sorted([len(world["tok"]), len(other)])
    assert {m["tokenizer"] for m in metas} == {str(world["ckpt"]), str(different)}


def test_a_tokenizer_larger_than_the_embedding_is_refused(world):
    small = _checkpoint(world["root"] / "llama-small", world["tok"], len(world["tok"]) - 8)
    with pytest.raises(DataError, match=rf"has {len(world['tok'])} tokens but the model's "):
        prepare_data(_spec(world, small))


def test_a_checkpoint_without_a_tokenizer_names_the_fix(world):
    bare = _checkpoint(world["root"] / "llama-bare", None, len(world["tok"]))
    with pytest.raises(DataError, match=r"holds no tokenizer.*--data.tokenizer=bpe"):
        _spec(world, bare)
    assert _spec(world, bare, "--data.tokenizer=bpe").tokenizer == ""  # the user's choice
    with pytest.raises(DataError, match=r"data.tokenizer='.*nowhere' is not a folder"):
        _spec(world, bare, f"--data.tokenizer={world['root'] / 'nowhere'}")


def test_train_refuses_before_any_process_starts(world, tmp_path):
    """Through the CLI: exit 2 and one line naming the sizes, no rank started."""
    small = world["root"] / "llama-small-cli"
    _checkpoint(small, world["tok"], len(world["tok"]) - 8)
    cmd = [sys.executable, "-m", "shardwise.cli.main", "train", "--nproc", "2"]
    cmd += [*_overrides(world, small), f"--run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "error: the tokenizer of" in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_training_from_the_checkpoint_with_its_tokenizer_runs_on_two_ranks(world, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardwise.cli.main", "train", "--nproc", "2"]
    cmd += _overrides(world, world["ckpt"], "--parallel.zero=3", "--train.global_batch=4")
    cmd += ["--train.steps=3", "--log.progress=off", f"--run.dir={run}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
