"""A pretrained model's own tokenizer for text data.

A checkpoint's embeddings mean something only for the ids its tokenizer produces, so when the
model comes from a checkpoint (`model.init_from`) its text data goes through the tokenizer
saved beside it (`data.tokenizer=auto`), loaded with transformers' `AutoTokenizer` and run on
the `tokenizers` fast path. Documents are packed as the tokenizer defines them: its special
tokens (a BOS where its post-processor adds one), then the end-of-sequence token after each
document. The token cache is keyed by the tokenizer files' content, so two tokenizers never
share one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from shardwise.data.cache import key_of
from shardwise.data.corpus import resolve_source
from shardwise.errors import DataError

# What `save_pretrained` writes for a tokenizer; the content of those present is the cache key.
FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",  # the chat template renders data.format=chat records
    "chat_template.json",
)


def has_tokenizer(path: str | Path) -> bool:
    p = Path(path)
    return (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file()


def tokenizer_dir(choice: str, init_from: str, dataset: str) -> str:
    """The folder whose tokenizer encodes the text ('' = train a BPE on the data), from
    `data.tokenizer` (auto | bpe | a folder) and `model.init_from`."""
    if dataset == "digits" or choice == "bpe" or (choice == "auto" and not init_from):
        return ""
    if choice == "auto":
        if has_tokenizer(init_from):
            return str(Path(init_from))
        raise DataError(
            f"model.init_from='{init_from}' holds no tokenizer (tokenizer.json or "
            "tokenizer_config.json), and its weights only make sense for its own token ids. "
            f"Fix: save it beside the weights (tokenizer.save_pretrained('{init_from}')), point "
            "--data.tokenizer at a folder that has it, or --data.tokenizer=bpe to train a new "
            "BPE on the data (for random weights: the checkpoint's ids are then lost)."
        )
    if not has_tokenizer(choice):
        raise DataError(
            f"data.tokenizer='{choice}' is not a folder with a Hugging Face tokenizer "
            "(tokenizer.json or tokenizer_config.json). Fix: the folder tokenizer.save_pretrained "
            "wrote, 'auto' (the checkpoint's) or 'bpe'."
        )
    return str(Path(choice))


def content_key(path: str | Path) -> str:
    """A hash of the tokenizer files' bytes, and of the folder's model type (transformers picks
    the tokenizer class by it, which may add special tokens): equal only for the same
    tokenizer."""
    h = hashlib.blake2b(digest_size=8)
    config = Path(path) / "config.json"
    if config.is_file():
        with contextlib.suppress(ValueError):  # not JSON: no model type to key by
            h.update(str(json.loads(config.read_text()).get("model_type")).encode())
    for name in FILES:
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def load_tokenizer(path: str | Path):  # -> transformers.PreTrainedTokenizerFast
    """`AutoTokenizer` from `path`, offline; a fast (Rust) tokenizer is required."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(
            "a checkpoint's tokenizer needs the `transformers` package. Fix: pip install "
            "-c constraints.txt -e '.[dev]'"
        ) from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... by case
        raise DataError(
            f"the tokenizer in '{path}' does not load: {type(exc).__name__}: {exc}. Fix: the "
            "folder that tokenizer.save_pretrained wrote."
        ) from None
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"the tokenizer in '{path}' has no fast (tokenizers) form. Fix: save it with "
            "tokenizer.json (AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained)."
        )
    return tok


def whole_documents(tok):  # -> tokenizers.Tokenizer
    """`tok`'s backend with truncation and padding off: a tokenizer saved for a classifier
    (all-MiniLM's: 128 tokens, padded) would otherwise cut every document of a corpus to that
    length and pad it, silently."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def encode_documents(
    backend, eos: int | None, texts: list[str], specials: bool = True
) -> list[list[int]]:
    """Each document's ids as the tokenizer defines them (its post-processor's special tokens),
    whole (`backend`: `whole_documents` of it, built once per corpus), followed by its
    end-of-sequence token `eos` when it has one and did not already add it. `specials=False`
    (our BPE, which has no post-processor): no special tokens added, `eos` after every one."""
    # encode_batch_fast skips offset tracking: ~2x faster, and offsets are unused
    encodings = backend.encode_batch_fast(texts, add_special_tokens=specials)
    out = []
    for enc in encodings:
        ids = list(enc.ids)
        if eos is not None and (not specials or not ids or ids[-1] != eos):
            ids.append(eos)
        out.append(ids)
    return out


def check_vocab(spec, meta: dict) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding (`spec`:
    the data's DataSpec, `meta`: its cache's, with the tokenizer's size)."""
    if meta["vocab_size"] > spec.vocab_size:
        name = meta.get("tokenizer") or spec.tokenizer or "bpe"
        raise DataError(
            f"the tokenizer of {name!r} has {meta['vocab_size']} tokens "
            f"but the model's embedding has {spec.vocab_size} rows: ids from "
            f"{spec.vocab_size} on would index past it. Fix: a model whose vocabulary holds the "
            f"tokenizer's (--model.vocab_size={meta['vocab_size']} for a preset), or the "
            "tokenizer saved with that model."
        )


def tokenized_key(spec, version: int, fields: list[str], **extra) -> str:
    """The cache key of records rendered with a checkpoint's tokenizer (data/classify.py,
    data/instruct.py): the cache format's `version`, the source files, the tokenizer's
    content, the `fields` read, seq_len and the split, and whatever `extra` the format adds."""
    ident = {
        "format": version,
        "files": resolve_source(spec).identity(),
        "tokenizer": content_key(spec.tokenizer),
        "fields": fields,
        "seq_len": spec.seq_len,
        "val_fraction": spec.val_fraction,
        **extra,
    }
    return key_of(ident)
