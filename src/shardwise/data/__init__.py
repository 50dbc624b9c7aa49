"""Real training data without downloads: text corpora, digits images and the global sampler.

`prepare_data(spec)` builds caches once (safe to call from every rank at once);
`load_data(spec, split)` returns a dataset with `get_batch(indices)`; `GlobalSampler` and
`split_for_rank` decide which indices each rank reads at each step.
"""

from __future__ import annotations

from shardwise.config import Config
from shardwise.data.blend import BlendDataset, load_blend
from shardwise.data.classify import ClassifyDataset, load_classify, prepare_classify
from shardwise.data.corpus import DataSpec
from shardwise.data.images import ImageDataset, load_digits
from shardwise.data.instruct import InstructDataset, load_instruct
from shardwise.data.pretrained import tokenizer_dir
from shardwise.data.sampler import GlobalSampler, split_for_rank
from shardwise.data.shards import ShardedTokenDataset, is_prepared, load_prepared
from shardwise.data.tokens import TokenDataset, load_tokens, prepare_text
from shardwise.data.user import UserDataset, load_user

__all__ = [
    "BlendDataset",
    "DataSpec",
    "GlobalSampler",
    "ImageDataset",
    "ShardedTokenDataset",
    "TokenDataset",
    "data_spec",
    "load_data",
    "load_held_out",
    "prepare_data",
    "split_for_rank",
]

SPLITS = ("train", "val")


def prepare_data(spec: DataSpec) -> None:
    """Build every cache `spec` needs (tokenizer, token arrays) if missing.

    Idempotent and safe when several processes call it at once (file lock, atomic writes).
    Raises DataError for missing, empty, unreadable or too-small data.
    """
    if spec.blend or is_prepared(spec.dataset):  # checked and mapped; tokenised already
        load_data(spec, "train")  # (a blend's raw corpora: their caches are built here)
        return
    if spec.dataset == "digits":
        return  # bundled with scikit-learn and tiny: loaded in memory, nothing to cache
    if spec.is_user:  # your dataset: imported and its first item read, nothing to cache
        load_user(spec.dataset, "train")
        return
    if spec.label_field:
        prepare_classify(spec)
        return
    if spec.format != "text":
        load_instruct(spec, "train")
        return
    prepare_text(spec)


def load_data(
    spec: DataSpec, split: str
) -> TokenDataset | ImageDataset | UserDataset | ClassifyDataset | InstructDataset | None:
    """The "train" or "val" split of `spec.dataset` (prepares the cache first if needed)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if spec.blend:
        return load_blend(spec, split)
    if is_prepared(spec.dataset):
        return load_prepared(spec, split)
    if spec.dataset == "digits":
        return load_digits(spec, split)
    if spec.is_user:
        return load_user(spec.dataset, split)  # None when your factory has no such split
    if spec.label_field:
        return load_classify(spec, split)
    if spec.format != "text":
        return load_instruct(spec, split)
    return load_tokens(spec, split)


def data_spec(cfg: Config, vocab_size: int, labelled: bool = False) -> DataSpec:
    """What the `data.*` section (and the model: its tokenizer) ask for; `vocab_size` is the
    model's embedding rows (a trained BPE's size, or the bound a tokenizer must fit);
    `labelled`: the model reads one label per row (its family is a classifier), so the rows
    carry `data.label_field`."""
    d = cfg.data
    return DataSpec(
        tokenizer=tokenizer_dir(d.tokenizer, cfg.model.init_from, d.dataset),
        label_field=d.label_field if labelled else "",
        format=d.format,
        fields=(d.prompt_field, d.input_field, d.response_field)
        if d.format == "instruction"
        else (d.messages_field,)
        if d.format == "chat"
        else (),
        dataset=d.dataset,
        seq_len=d.seq_len,
        vocab_size=vocab_size,
        text_field=d.text_field,
        val_fraction=d.val_fraction,
        image_size=d.image_size,
        cache_dir=d.cache_dir,
        max_bad_rows=d.max_bad_rows,
        pack=d.pack,
        # the run's own outputs are never its data (a dataset folder may hold the run)
        exclude=(cfg.run.dir, cfg.checkpoint.dir),
        blend=d.blend,
    )


def load_held_out(cfg: Config, vocab_size: int, labelled: bool = False):
    """The held-out split the config asks for (None: it holds nothing out)."""
    spec = data_spec(cfg, vocab_size, labelled)
    if cfg.data.val_fraction > 0 or cfg.data.dataset == "digits" or spec.is_user:
        return load_data(spec, "val")
    return None
