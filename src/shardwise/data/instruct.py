"""Instruction and chat records (`data.format = instruction | chat`): one record per sample,
the loss on the response tokens only.

* instruction: Alpaca-style rows (instruction, optional input, response; field names in
  `data.prompt_field`, `data.input_field`, `data.response_field`), the prompt rendered with
  the Alpaca template (Taori et al. 2023), the response followed by the end-of-sequence token;
* chat: a list of `{role, content}` messages (`data.messages_field`) rendered with the
  tokenizer's own chat template; every assistant turn is a target. A turn's tokens are found by
  rendering the conversation up to the turn with the generation prompt, then up to its end:
  the difference is the turn (the template must render each prefix as a prefix; one that does
  not is refused).

A sample is the record's ids cut to seq_len + 1: inputs are ids[:-1], targets ids[1:] with
every position whose next token is not a response token set to -100 (ignored by the loss),
right-padded (the pads are ignored too, and a causal model never attends forward, so no
attention mask is needed). The loss is divided by the global count of target tokens of the
step (`targets_in`, computed by every rank from the step's global indices: no collective, the
same in every layout). Records whose response is cut off entirely are dropped (counted).

Packing (`data.pack=true`): consecutive records share a row while they fit (first fit in
order; a row never splits a record), and a batch is `[B, 2, S]`: the ids and each position's
record number in its row (models/packing.py masks attention to the record and restarts its
positions). Rows, not records, are then the samples; the cache holds records either way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from shardwise.data.cache import build_once, save_array
from shardwise.data.columns import builder_of, load_column
from shardwise.data.corpus import DataSpec, resolve_source, split_documents
from shardwise.data.pretrained import check_vocab, load_tokenizer, tokenized_key
from shardwise.errors import DataError

FORMAT = 2  # 2: records' lengths cached (packing)
IGNORE = -100  # torch's cross_entropy ignore_index: no loss, no gradient
ALPACA = (
    "Below is an instruction that describes a task{with_input}. Write a response that "
    "appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n{input_part}"
    "### Response:\n"
)


def alpaca_prompt(instruction: str, input_text: str) -> str:
    if input_text:
        return ALPACA.format(
            with_input=", paired with an input that provides further context",
            instruction=instruction,
            input_part=f"### Input:\n{input_text}\n\n",
        )
    return ALPACA.format(with_input="", instruction=instruction, input_part="")


class InstructDataset:
    tokens_per_sample: int

    def __init__(self, root: Path, split: str, meta: dict, pack: bool = False) -> None:
        self.kind = meta["kind"]
        self.inputs = np.load(root / f"{split}.inputs.npy", mmap_mode="r")
        self.targets = np.load(root / f"{split}.targets.npy", mmap_mode="r")
        self.counts = np.load(root / f"{split}.counts.npy")
        self.lengths = np.load(root / f"{split}.lengths.npy")
        self.vocab_size: int = meta["vocab_size"]
        self.tokens_per_sample = self.inputs.shape[1]
        # records [rows[r], rows[r + 1]) share row r (one record per row unpacked)
        n = len(self.counts)
        self.rows = pack_rows(self.lengths, self.tokens_per_sample) if pack else np.arange(n + 1)
        self.packed = pack
        self.row_counts = np.add.reduceat(self.counts, self.rows[:-1]) if n else self.counts

    def __len__(self) -> int:
        return len(self.rows) - 1

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): int64 [B, seq_len], targets -100 outside responses; packed, the
        inputs are [B, 2, seq_len]: ids and record numbers (models/packing.py)."""
        idx = torch.as_tensor(indices, dtype=torch.int64).numpy()
        if not self.packed:
            x = torch.from_numpy(np.asarray(self.inputs[idx], np.int64))
            return x, torch.from_numpy(np.asarray(self.targets[idx], np.int64))
        s = self.tokens_per_sample
        x = np.zeros((len(idx), 2, s), np.int64)  # filler: id 0, record 0, no target
        y = np.full((len(idx), s), IGNORE, np.int64)
        for b, r in enumerate(idx):
            at = 0
            for k, i in enumerate(range(self.rows[r], self.rows[r + 1]), start=1):
                n = int(self.lengths[i])
                x[b, 0, at : at + n] = self.inputs[i, :n]
                x[b, 1, at : at + n] = k
                y[b, at : at + n] = self.targets[i, :n]
                at += n
        return torch.from_numpy(x), torch.from_numpy(y)

    def targets_in(self, indices) -> int:
        """Target (response) tokens in the samples `indices`: the loss normaliser."""
        idx = torch.as_tensor(indices, dtype=torch.int64).numpy()
        return int(self.row_counts[idx].sum())


def pack_rows(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Row boundaries of records packed in order: row r holds records [out[r], out[r+1]),
    a new row whenever the next record does not fit in what is left of seq_len."""
    bounds, used = [0], 0
    for i, n in enumerate(lengths):
        if used and used + n > seq_len:
            bounds.append(i)
            used = 0
        used += int(n)
    if len(lengths):
        bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


def _records(spec: DataSpec) -> tuple[list, list]:
    """(train records, held-out records): each the record's fields as read."""
    source = resolve_source(spec)
    key = "data.format"
    if source.is_stdlib:
        raise DataError(
            f"{key}={spec.format} needs records, and data.dataset=stdlib is plain text. Fix: a "
            ".jsonl/.json/.parquet file of records, or --data.format=text."
        )
    names = {
        "instruction": ("data.prompt_field", "data.input_field", "data.response_field"),
        "chat": ("data.messages_field",),
    }[spec.format]
    docs = []
    for path, rel in zip(source.files, source.ids, strict=True):
        builder = builder_of(path.suffix.lower())
        columns = [
            load_column(path, builder, field, name) if field else None
            for field, name in zip(spec.fields, names, strict=True)
        ]
        n = len(next(c for c in columns if c is not None))
        for i in range(n):
            record = [c[i] if c is not None else "" for c in columns]
            _check(spec, record, f"record {i} of '{path}'")
            docs.append((f"{rel}#{i}", json.dumps(record)))
    train, val = split_documents(docs, spec.val_fraction, spec.dataset)
    return [json.loads(r) for r in train], [json.loads(r) for r in val]


def _check(spec: DataSpec, record: list, where: str) -> None:
    if spec.format == "instruction":
        prompt, inp, response = record
        for field, value in ((spec.fields[0], prompt), (spec.fields[2], response)):
            if not isinstance(value, str) or not value:
                raise DataError(
                    f"{where} has no text in field '{field}' ({value!r}). Fix: fill or drop "
                    "that record, or point data.prompt_field / data.response_field at the "
                    "fields holding the instruction and the response."
                )
        if inp is not None and not isinstance(inp, str):
            raise DataError(f"{where}: field '{spec.fields[1]}' is {inp!r}, not text.")
        return
    (messages,) = record
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok or not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"{where}: field '{spec.fields[0]}' is not a list of {{role, content}} messages with "
            f'an assistant turn ({str(messages)[:120]}). Fix: records like {{"messages": '
            '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}.'
        )


def _ids(out) -> list[int]:
    """apply_chat_template's ids, whichever form this transformers returns them in."""
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _chat_pieces(tok, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
    """The rendered conversation's ids and, per id, whether it belongs to an assistant turn."""
    full = _ids(tok.apply_chat_template(messages, tokenize=True))
    target = [False] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _ids(
            tok.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True)
        )
        upto = _ids(tok.apply_chat_template(messages[: i + 1], tokenize=True))
        if full[: len(before)] != before or full[: len(upto)] != upto:
            raise DataError(
                f"{where}: the tokenizer's chat template does not render the conversation up "
                f"to turn {i} as a prefix of the whole, so the assistant's tokens cannot be "
                "told apart. Fix: a template that renders turns in order (most do), or "
                "--data.format=instruction."
            )
        for j in range(len(before), len(upto)):
            target[j] = True
    return full, target


def _encode(spec: DataSpec, tok, record: list, where: str) -> tuple[list[int], list[bool]]:
    if spec.format == "chat":
        return _chat_pieces(tok, record[0], where)
    prompt = tok(alpaca_prompt(record[0], record[1] or ""), add_special_tokens=True)["input_ids"]
    response = tok(record[2], add_special_tokens=False)["input_ids"]
    if tok.eos_token_id is not None:
        response = [*response, tok.eos_token_id]
    return [*prompt, *response], [False] * len(prompt) + [True] * len(response)


def _sample(ids: list[int], target: list[bool], seq_len: int, pad: int):
    """(inputs, targets, length) of seq_len; targets -100 where the next token is not a
    response; length: the positions before the padding."""
    ids, target = ids[: seq_len + 1], target[: seq_len + 1]
    x = np.full(seq_len, pad, dtype=np.int64)
    y = np.full(seq_len, IGNORE, dtype=np.int64)
    n = len(ids) - 1
    x[:n] = ids[:-1]
    nxt = np.asarray(ids[1:], dtype=np.int64)
    y[:n] = np.where(np.asarray(target[1:], dtype=bool), nxt, IGNORE)
    return x, y, n


def _key(spec: DataSpec) -> str:
    return tokenized_key(spec, FORMAT, list(spec.fields), kind=spec.format)


def _root(spec: DataSpec) -> Path:
    if not spec.tokenizer:
        raise DataError(
            f"data.format={spec.format} renders records with the model's own tokenizer, and "
            "none is set. Fix: --model.init_from=DIR holding one (data.tokenizer=auto), or "
            "--data.tokenizer=DIR."
        )
    return spec.cache_root() / f"{spec.format}-{_key(spec)}"


def _build(spec: DataSpec, root: Path) -> dict:
    tok = load_tokenizer(spec.tokenizer)
    if spec.format == "chat" and not getattr(tok, "chat_template", None):
        raise DataError(
            f"data.format=chat renders messages with the tokenizer's chat template, and the "
            f"tokenizer in '{spec.tokenizer}' has none. Fix: a tokenizer with a chat_template "
            "(an instruction-tuned checkpoint's), or --data.format=instruction."
        )
    train, val = _records(spec)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    meta = {"format": FORMAT, "kind": spec.format, "vocab_size": len(tok)}
    for split, records in (("train", train), ("val", val)):
        xs, ys, ns = [], [], []
        for i, record in enumerate(records):
            encoded = _encode(spec, tok, record, f"{split} record {i}")
            x, y, n = _sample(*encoded, spec.seq_len, pad)
            if (y != IGNORE).any():
                xs.append(x)
                ys.append(y)
                ns.append(n)
        dropped = len(records) - len(xs)
        if dropped:
            print(
                f"shardwise: {dropped} of {len(records)} {split} records dropped: the prompt "
                f"fills all data.seq_len={spec.seq_len} tokens, leaving no response to learn",
                file=sys.stderr,
            )
        if split == "train" and not xs:
            raise DataError(
                f"no {spec.format} record of '{spec.dataset}' has a response token within "
                f"data.seq_len={spec.seq_len}. Fix: a larger --data.seq_len."
            )
        dtype = np.int32
        empty = np.zeros((0, spec.seq_len))
        save_array(root / f"{split}.inputs.npy", np.asarray(xs or empty, dtype=dtype))
        save_array(root / f"{split}.targets.npy", np.asarray(ys or empty, dtype=dtype))
        counts = np.asarray([(y != IGNORE).sum() for y in ys], dtype=np.int64)
        save_array(root / f"{split}.counts.npy", counts)
        save_array(root / f"{split}.lengths.npy", np.asarray(ns, dtype=np.int64))
        meta[f"{split}_records"] = len(xs)
    return meta


def load_instruct(spec: DataSpec, split: str) -> InstructDataset | None:
    root = _root(spec)
    meta = build_once(root, lambda r: _build(spec, r))
    check_vocab(spec, meta)
    if split == "val" and meta["val_records"] == 0:
        return None
    data = InstructDataset(root, split, meta, spec.pack)
    if spec.pack and split == "train":
        filled = data.lengths.sum() / max(1, len(data) * data.tokens_per_sample)
        print(
            f"shardwise: packed {len(data.lengths)} records into {len(data)} rows of "
            f"{data.tokens_per_sample} tokens ({filled:.0%} of positions hold a record)",
            file=sys.stderr,
        )
    return data
