"""PyTorch distributed checkpoints (DCP) into our decoders: `model.init_from=DIR` where DIR
is what `torch.distributed.checkpoint.save` wrote, under our names (`shardwise export
--format dcp`) or torchtitan's Llama names (flat, or under "model." as its step checkpoints
keep the model beside the optimizer), read tensor by tensor.

A DCP holds no config: the model's shape is the config's (`model.name` and `model.*`), and
every parameter must find a tensor of its shape in the checkpoint's metadata, checked before
launch. A rank reads a whole tensor at a time (DCP reads slices only into sharded targets) and
keeps the rows it needs.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

from shardwise.errors import ConfigError
from shardwise.models.hf.weights import HFWeights

METADATA = ".metadata"
_PREFIX = "model."  # torchtitan's step checkpoints: {"model": ..., "optimizer": ...}

# torchtitan's Llama (torchtitan/models/llama3/model.py) -> ours (models/decoder.py); its w1,
# w2, w3 are ours (gate, down, up). Its q/k rows pair RoPE channels (2i, 2i+1), as Meta's
# weights do; ours pair (i, i + D/2) as Hugging Face's Llama: permuted on read (`from_meta_rope`).
_TITAN = (
    (r"tok_embeddings\.weight", "embed.weight"),
    (r"layers\.(\d+)\.attention\.w([qkvo])\.weight", "blocks.{0}.attn.w{1}.weight"),
    (r"layers\.(\d+)\.feed_forward\.w([123])\.weight", "blocks.{0}.mlp.w{1}.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "blocks.{0}.attn_norm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "blocks.{0}.mlp_norm.weight"),
    (r"norm\.weight", "norm.weight"),
    (r"output\.weight", "head.weight"),
)


def is_dcp(path: str | Path) -> bool:
    """Whether `path` is a directory `torch.distributed.checkpoint.save` wrote."""
    return (Path(path) / METADATA).is_file()


def tensor_sizes(
    path: Path, key: str = "model.init_from"
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor's key, global shape and dtype, from the checkpoint's metadata (`key`: the
    config key that named `path`, for the error)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a truncated or foreign .metadata (pickle errors of any kind)
        raise ConfigError(
            f"{key}='{path}': its {METADATA} cannot be read ({exc}). Fix: point {key} at a "
            "complete checkpoint that torch.distributed.checkpoint.save wrote."
        ) from None
    return {
        k: (v.size, v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def titan_name(key: str) -> tuple[str, bool] | None:
    """(our name, whether its rows are in torchtitan's RoPE order) of a torchtitan Llama
    parameter `key` (with or without "model."); None if it is none of its names."""
    name = key.removeprefix(_PREFIX)
    for theirs, mine in _TITAN:
        m = re.fullmatch(theirs, name)
        if m:
            mine = mine.format(*m.groups())
            return mine, mine.endswith((".wq.weight", ".wk.weight"))
    return None


def _ours(key: str) -> tuple[str, bool]:
    """(our name, whether its rows are in torchtitan's RoPE order) of checkpoint `key`."""
    return titan_name(key) or (key.removeprefix(_PREFIX), False)


class DCPWeights(HFWeights):
    """Reads our parameters from a DCP directory, whole tensor by whole tensor (the last one
    kept, as a rank reads a parameter's rows in order)."""

    def __init__(self, path: str | Path, spec) -> None:
        self.path, self.spec = Path(path), spec
        self.elements_read = 0
        self.sizes = tensor_sizes(self.path)
        self.keys: dict[str, tuple[str, bool]] = {}
        for key in self.sizes:
            name, rotary = _ours(key)
            if name not in self.keys or key == name:  # our own name wins over a prefixed one
                self.keys[name] = (key, rotary)
        self._last: tuple[str, torch.Tensor] | None = None

    def _tensor(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        if self._last is not None and self._last[0] == name:
            return self._last[1]
        if name not in self.keys:
            raise ConfigError(f"model.init_from='{self.path}' has no tensor for '{name}'.")
        key, rotary = self.keys[name]
        size, dtype = self.sizes[key]
        out = torch.empty(size, dtype=dtype)
        with warnings.catch_warnings():  # "assuming ... a single process": it is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            # each rank reads alone: DCP's own collectives would run on the training group
            dcp.load({key: out}, checkpoint_id=str(self.path), no_dist=True)
        if rotary:
            heads = self.spec.n_heads if name.endswith(".wq.weight") else self.spec.n_kv_heads
            out = from_meta_rope(out, heads)
        self._last = (name, out)
        return out

    def rows(self, name: str, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of our parameter `name` of `shape`, float32."""
        value = self._tensor(name)[r0:r1].float().contiguous()
        if not torch.isfinite(value).all():  # training would stop at step 1 without a name
            raise ConfigError(
                f"model.init_from='{self.path}': tensor '{self.keys[name][0]}' holds a "
                "non-finite value. Fix: load a checkpoint saved before the values diverged."
            )
        return value

    def has(self, name: str) -> bool:
        return name in self.keys

    def close(self) -> None:
        self._last = None


def from_meta_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from RoPE pairs (2i, 2i+1) per head to pairs (i, i + D/2): the permutation
    transformers' Llama conversion applies to Meta's weights (and, row for row, to AdamW's
    moments of them: the update is element-wise)."""
    out_dim, dim = w.shape
    return w.view(heads, out_dim // heads // 2, 2, dim).transpose(1, 2).reshape(out_dim, dim)


def check_dcp(spec, path: str | Path) -> None:
    """Every parameter of our decoder has a tensor of its shape in the checkpoint (checked on
    the metadata, before launch)."""
    from shardwise.models.decoder import Decoder
    from shardwise.models.init import canonical_name

    with torch.device("meta"):
        model = Decoder(spec)  # (init_from maps into our decoders: decoder or gpt2)
    reader, problems = DCPWeights(path, spec), []
    for name, p in model.named_parameters():
        name = canonical_name(name, spec)
        if name not in reader.keys:
            problems.append(f"no tensor for '{name}'")
            continue
        key = reader.keys[name][0]
        got = tuple(reader.sizes[key][0])
        if got != tuple(p.shape):
            problems.append(f"'{key}' has shape {list(got)}, '{name}' is {list(p.shape)}")
    head = reader.keys.get("head.weight", ("", False))[0]
    # a torchtitan head (its own layout never ties) would be left unread; ours writes the tied
    # head beside the embedding it equals
    if spec.tie_embeddings and head and head != "head.weight":
        problems.append(
            f"it has an output head of its own ('{head}') and the "
            "model ties its head to the embedding (model.tie_embeddings=false keeps it)"
        )
    if problems and any(k.startswith("param/") for k in reader.sizes):
        raise ConfigError(  # its keys are `param/NAME`, `exp_avg/NAME`...: not a model's
            f"model.init_from='{path}' is a shardwise training checkpoint saved with "
            "checkpoint.format=dcp (model and optimizer state under their own keys), not a "
            "model's state dict. Fix: continue it with --checkpoint.resume="
            f"{path}, or export its model with `shardwise export {path} --format dcp OUT` "
            "and pass --model.init_from=OUT."
        )
    if problems:
        raise ConfigError(
            f"model.init_from='{path}' (a distributed checkpoint) does not fit "
            f"model.name's {spec.arch} model: " + "; ".join(problems[:6]) + ". Fix: set "
            "model.name and model.* to the checkpoint's shape (a DCP holds no config)."
        )
