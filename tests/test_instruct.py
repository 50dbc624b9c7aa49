"""Instruction and chat data: prompts carry no loss, chat uses the tokenizer's
own template, bad records and tokenizers are refused with the fix."""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.config import load_config  # noqa: E402
from shardwise.data import data_spec, load_data  # noqa: E402
from shardwise.data.instruct import IGNORE, alpaca_prompt  # noqa: E402
from shardwise.errors import DataError  # noqa: E402
from test_pretrained_tokenizer import _documents, _tokenizer  # noqa: E402

# A template in the style of ChatML: every turn between <|im_start|>role and <|im_end|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def instruction_checkpoint(root, max_positions: int) -> list[str]:
    """A tiny Llama checkpoint (random weights) with a tokenizer trained here in root/ckpt,
    and Alpaca records from real text in root/inst.jsonl; returns the documents."""
    docs = _documents()
    tok = _tokenizer(320, docs)
    tok.save_pretrained(root / "ckpt")
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "ckpt")
    records = [{**r, "input": ""} for r in instruction_records(docs)]
    (root / "inst.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return docs


def instruction_records(docs: list[str]) -> list[dict]:
    """Alpaca-style records from real text: summarise a docstring by its first line."""
    out = []
    for i, doc in enumerate(docs):
        first, _, rest = doc.partition("\n")
        out.append(
            {
                "instruction": "Give the first line of this documentation.",
                "input": rest[:200] if i % 2 else "",
                "output": first,
            }
        )
    return out


def chat_records(docs: list[str]) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"What does this say? {d[:80]}"},
                {"role": "assistant", "content": d.partition("\n")[0]},
                {"role": "user", "content": "Thanks. And the rest?"},
                {"role": "assistant", "content": d[80:160]},
            ]
        }
        for d in docs
    ]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("instruct")
    docs = _documents()
    tok = _tokenizer(320, docs)
    tok.save_pretrained(root / "plain")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(root / "chat")
    write_jsonl(root / "inst.jsonl", instruction_records(docs))
    write_jsonl(root / "chat.jsonl", chat_records(docs))
    return root


def _data(folder, fmt: str, dataset: str, tokenizer: str, *extra: str):
    cfg = load_config(
        None,
        [
            f"--data.dataset={folder / dataset}",
            f"--data.format={fmt}",
            f"--data.tokenizer={folder / tokenizer}",
            f"--data.cache_dir={folder / 'cache'}",
            "--data.seq_len=512",
            "--data.val_fraction=0.1",
            *extra,
        ],
    )
    return load_data(data_spec(cfg, 4096), "train")


def test_instruction_prompts_carry_no_loss(folder):
    data = _data(folder, "instruction", "inst.jsonl", "plain")
    tok = transformers.AutoTokenizer.from_pretrained(folder / "plain")
    rows = {r["output"]: r for r in instruction_records(_documents())}
    x, y = data.get_batch(torch.arange(8))
    assert x.shape == y.shape == (8, 512)
    for i in range(8):
        n = int((y[i] != IGNORE).sum())
        assert n == data.targets_in([i]) > 0
        # the targets are exactly the response and the end-of-sequence token ...
        response = tok.decode(y[i][y[i] != IGNORE])
        assert response.endswith(tok.eos_token)
        record = rows[response.removesuffix(tok.eos_token)]
        # ... and the inputs are the Alpaca prompt followed by the response (targets shifted)
        text = tok.decode(x[i][: int((y[i] != IGNORE).nonzero().max()) + 1])
        assert text == "<s>" + alpaca_prompt(record["instruction"], record["input"]) + (
            response.removesuffix(tok.eos_token)
        )
        prompt_len = len(tok(alpaca_prompt(record["instruction"], record["input"]))["input_ids"])
        assert (y[i][: prompt_len - 1] == IGNORE).all()  # no prompt token is a target
    assert data.targets_in(range(8)) == int((y != IGNORE).sum())


def test_chat_uses_the_tokenizers_template_and_learns_assistant_turns_only(folder):
    data = _data(folder, "chat", "chat.jsonl", "chat")
    tok = transformers.AutoTokenizer.from_pretrained(folder / "chat")
    x, y = data.get_batch(torch.arange(4))
    for i in range(4):
        rendered = tok.decode(x[i])
        assert rendered.startswith("<|im_start|>user\nWhat does this say?")  # the template's
        kept = y[i] != IGNORE
        learned = tok.decode(y[i][kept])
        assert "What does this say?" not in learned and "Thanks." not in learned
        assert "<|im_end|>" in learned  # the assistant's turn ends where its template ends it
        # two assistant turns, each a contiguous run of targets
        runs = int((kept[1:] & ~kept[:-1]).sum()) + int(kept[0])
        assert runs == 2


def test_bad_records_and_tokenizers_are_refused(folder):
    no_template = re.escape("has none. Fix: a tokenizer with a chat_template")
    with pytest.raises(DataError, match=no_template):
        _data(folder, "chat", "chat.jsonl", "plain")
    with pytest.raises(DataError, match="'reply' is not a column"):
        _data(folder, "instruction", "inst.jsonl", "plain", "--data.response_field=reply")
    write_jsonl(folder / "holes.jsonl", [{"instruction": "x", "input": "", "output": ""}] * 3)
    with pytest.raises(DataError, match="has no text in field 'output'"):
        _data(folder, "instruction", "holes.jsonl", "plain")
    write_jsonl(folder / "nochat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    with pytest.raises(DataError, match="with an assistant turn"):
        _data(folder, "chat", "nochat.jsonl", "chat")
    with pytest.raises(DataError, match=re.escape("Fix: a larger --data.seq_len")):
        _data(folder, "instruction", "inst.jsonl", "plain", "--data.seq_len=8")
