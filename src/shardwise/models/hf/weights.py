"""Hugging Face weights into our decoders (`model.init_from` with a Llama or GPT-2 preset):
the model shape read from a checkpoint's `config.json`, checked against its tensors before
launch, and a weight source that reads any row range of any of our parameters straight from
the safetensors files (so a rank loads only the slices it keeps). The per-architecture maps
are models/hf/llama.py and gpt2.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from shardwise.errors import ConfigError
from shardwise.models.hf import glm4_moe, gpt2, llama
from shardwise.models.hf.rule import Rule, hf_shape
from shardwise.models.presets import HF_ARCHS

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


# (the MoE decoder maps one way: its export as Qwen2-MoE or GLM-4-MoE, whose names are
# Qwen2-MoE's plus the shared experts; init_from into it is refused)
RULES = {"decoder": llama.RULES, "gpt2": gpt2.RULES, "moe": glm4_moe.RULES}
MODEL_TYPES = {"llama": "decoder", "gpt2": "gpt2"}
FIELDS = {"llama": llama.fields, "gpt2": gpt2.fields}
# Parameters a fine-tune adds to the decoder (peft's adapters), never in a base checkpoint.
_ADDED = re.compile(r"\.lora_[AB]\.")
# Buffers some GPT-2 checkpoints carry (the causal mask), not parameters.
_IGNORED = re.compile(r"(^|\.)attn\.(bias|masked_bias)$|rotary_emb\.inv_freq$")


def rule_for(arch: str, name: str) -> tuple[Rule, str]:
    """The rule mapping our parameter `name` and the Hugging Face tensor name it reads
    (`hf` and the hf-* presets: transformers' own model, its names are the checkpoint's)."""
    if arch == "hf" or arch in HF_ARCHS:
        return Rule(re.escape(name), name), name
    for rule in RULES[arch]:
        m = re.fullmatch(rule.ours, name)
        if m:
            return rule, rule.theirs.format(*m.groups())
    raise ConfigError(f"no Hugging Face name for parameter '{name}' of a {arch} model")


def checkpoint_dir(path: str | Path) -> Path:
    """`path` as a Hugging Face checkpoint folder (config.json inside), or one message."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(
            f"model.init_from='{path}' is not a directory. Fix: point it at a Hugging Face "
            f"model directory holding {CONFIG} and {SINGLE} (or sharded *.safetensors + {INDEX})."
        )
    if not (p / CONFIG).is_file():
        raise ConfigError(
            f"model.init_from='{path}' has no {CONFIG}. Fix: save the model with "
            "`save_pretrained(dir)` or copy its config.json next to the weights."
        )
    return p


def read_config(path: str | Path) -> dict:
    """The Hugging Face `config.json` in directory `path`, or a message saying what is wrong."""
    cfg = json.loads((checkpoint_dir(path) / CONFIG).read_text())
    if cfg.get("model_type") not in MODEL_TYPES:
        raise ConfigError(
            f"model.init_from='{path}' holds a '{cfg.get('model_type')}' model; shardwise reads "
            f"{sorted(MODEL_TYPES)}. Fix: convert it, or train from scratch without init_from."
        )
    return cfg


def weight_files(path: str | Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    p = Path(path)
    if (p / INDEX).is_file():
        try:
            index = json.loads((p / INDEX).read_text())
            files = {k: p / f for k, f in index["weight_map"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _unreadable(p / INDEX, f"not a safetensors index ({exc})") from None
        _check_unique(path, sorted(set(files.values())))
        return files
    if (p / SINGLE).is_file():
        with _open(p / SINGLE) as f:
            return {k: p / SINGLE for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    raise ConfigError(
        f"model.init_from='{path}' has neither {SINGLE} nor {INDEX}. Fix: save with "
        "`save_pretrained(dir, safe_serialization=True)`."
    )


def _check_unique(path: str | Path, shards: list[Path]) -> None:
    """Refuse a tensor stored in two shards: which copy a loader takes is up to it (the index
    names one, transformers may load the other), so the model would silently depend on it."""
    seen: dict[str, Path] = {}
    for shard in shards:
        if not shard.is_file():
            continue  # named when a tensor in it is read (HFWeights._slice)
        with _open(shard) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                if key in seen:
                    raise ConfigError(
                        f"model.init_from='{path}': tensor '{key}' is stored twice, in "
                        f"{seen[key].name} and {shard.name}, and loaders may take either copy. "
                        "Fix: save the checkpoint again (save_pretrained writes each tensor "
                        "once), or delete it from the shard the index does not name."
                    )
                seen[key] = shard


# Bytes hashed at the start, middle and end of each weight file to tell a changed base from
# a copy (contents, not mtimes, which a copy resets): a different model of the same shapes
# differs in nearly every value, so in these blocks too.
SAMPLE = 65536


def base_identity(path: str | Path) -> dict[str, list]:
    """file name -> [size, hash of sampled blocks] of a checkpoint folder's weights, index and
    config (cheap: three blocks per file); of a distributed checkpoint's data files and
    metadata."""
    import hashlib

    p, out = Path(path), {}
    weights = {f.name for pattern in ("*.safetensors", "*.distcp") for f in p.glob(pattern)}
    names = sorted(weights | {INDEX, CONFIG, ".metadata"})
    for name in names:
        f = p / name
        if not f.is_file():
            continue
        size, h = f.stat().st_size, hashlib.blake2b(digest_size=8)
        with open(f, "rb") as fh:
            for at in sorted({0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)}):
                fh.seek(at)
                h.update(fh.read(SAMPLE))
        out[name] = [size, h.hexdigest()]
    return out


class HFWeights:
    """Reads our parameters from Hugging Face safetensors, any row range at a time (a
    ZeRO-3 rank reads its slices, a tensor-parallel rank its rows, nobody the whole model)."""

    def __init__(self, path: str | Path, arch: str) -> None:
        self.path, self.arch = Path(path), arch
        self.files = weight_files(path)
        self._open: dict[Path, object] = {}
        self.elements_read = 0  # through `span` (the quantised base checks its reads)

    def _slice(self, key: str):
        if key not in self.files:
            raise ConfigError(f"model.init_from='{self.path}' has no tensor '{key}'.")
        f = self.files[key]
        if f not in self._open:
            self._open[f] = _open(f)
        return self._open[f].get_slice(key)

    def rows(self, name: str, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) (along our dim 0) of our parameter `name` of `shape`, float32."""
        rule, key = rule_for(self.arch, name)
        sl = self._slice(key)
        c0 = rule.part * shape[0]
        # Conv1D (GPT-2) stores (in, out): our rows are its columns
        try:
            value = sl[:, c0 + r0 : c0 + r1].t() if rule.transposed else sl[c0 + r0 : c0 + r1]
        except Exception as exc:  # safetensors' own error type: a file cut short
            raise _unreadable(self.files[key], f"tensor '{key}' cannot be read ({exc})") from None
        value = value.float().contiguous()
        if not torch.isfinite(value).all():  # training would stop at step 1 without a name
            bad = (~torch.isfinite(value)).nonzero()[0].tolist()
            raise ConfigError(
                f"model.init_from='{self.path}': tensor '{key}' ({self.files[key].name}) holds "
                f"a non-finite value ({value[tuple(bad)].item()} at local index {bad}). Fix: "
                "load a checkpoint saved before the values diverged, or repair that tensor."
            )
        return value

    def full(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.rows(name, shape, 0, shape[0]).reshape(shape)

    def span(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flattened parameter (a ZeRO slice), reading only
        the rows they lie in."""
        row = 1
        for s in shape[1:]:
            row *= s
        r0, r1 = start // row, -(-stop // row)
        flat = self.rows(name, shape, r0, r1).flatten()
        self.elements_read += flat.numel()
        return flat[start - r0 * row : stop - r0 * row]

    def local(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """This rank's tensor of `param` (the whole parameter, or its tensor-parallel shard
        `param.tp_slice`: a row shard reads only its rows, a fused one its blocks)."""
        cut = getattr(param, "tp_slice", None)
        if cut is None:
            return self.full(name, tuple(param.shape))
        full = cut.full_shape
        if cut.dim != 0:  # a column shard of a row-major tensor: cut it from the whole
            return cut.take(self.full(name, full))
        pieces = []
        for a, b in cut.ranges:  # rows past the real size are the vocabulary padding: zeros
            if min(b, full[0]) > a:
                pieces.append(self.rows(name, full, a, min(b, full[0])))
            if b > max(a, full[0]):
                pieces.append(torch.zeros((b - max(a, full[0]), *full[1:])))
        return torch.cat(pieces).reshape(param.shape)

    def span_of(self, name: str, param: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of this rank's flattened `param` (a ZeRO slice of it)."""
        if getattr(param, "tp_slice", None) is None:
            return self.span(name, tuple(param.shape), start, stop)
        return self.local(name, param).flatten()[start:stop]

    def has(self, name: str) -> bool:
        """Every parameter of our decoders is in the checkpoint (check_weights, at launch);
        parameters added to it (LoRA adapters) are not: they start from (seed, name)."""
        return not _ADDED.search(name)

    def buffers(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Persistent buffer values the checkpoint gives `model` by name: none for our decoders
        (their buffers are computed; a GPT-2 checkpoint's causal mask is not read)."""
        return {}

    def close(self) -> None:
        self._open.clear()


def _open(path: Path):
    """`safe_open(path)`, or one message naming the file."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt")
    except Exception as exc:  # safetensors' SafetensorError (a Rust error), or an OSError
        raise _unreadable(path, f"not a readable safetensors file ({exc})") from None


def _unreadable(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"model.init_from: {path} is {why}. Fix: save or download the checkpoint again "
        "(`save_pretrained(dir, safe_serialization=True)`); a copy cut short is the usual cause."
    )


def spec_fields(cfg: dict, path: str | Path) -> dict:
    """ModelSpec fields of the Hugging Face model described by `cfg` (its config.json)."""
    return FIELDS[cfg["model_type"]](cfg, path)


SHAPE_KEYS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


def adapt_spec(spec, model_cfg, path: str | Path):
    """The ModelSpec of the checkpoint at `path`: shape, norm epsilon, RoPE base and
    position table come from its config.json. `model.name` must be of the same family and
    explicit `model.*` overrides must agree with it (a silent change would be worse)."""
    import dataclasses

    fields = spec_fields(read_config(path), path)
    arch = fields.pop("arch")
    if arch != spec.arch:
        fix = "gpt2-tiny" if arch == "gpt2" else "tiny"
        raise ConfigError(
            f"model.name='{model_cfg.name}' is a {spec.arch} model but model.init_from="
            f"'{path}' holds a {arch} model. Fix: --model.name={fix} (its sizes are then read "
            "from the checkpoint)."
        )
    for key in SHAPE_KEYS:
        mine = getattr(model_cfg, key)
        if mine and mine != fields[key]:
            raise ConfigError(
                f"model.{key}={mine} but model.init_from='{path}' has {key}={fields[key]}. "
                f"Fix: --model.{key}=0 (take it from the checkpoint)."
            )
    width = fields.get("head_dim_override") or fields["dim"] // fields["n_heads"]
    if model_cfg.head_dim and model_cfg.head_dim != width:
        raise ConfigError(
            f"model.head_dim={model_cfg.head_dim} but model.init_from='{path}' has heads of "
            f"{width} channels. Fix: --model.head_dim=0 (take it from the checkpoint)."
        )
    tie = model_cfg.tie_embeddings
    if tie != "preset" and (tie == "true") != fields["tie_embeddings"]:
        raise ConfigError(
            f"model.tie_embeddings={tie} but model.init_from='{path}' has "
            f"tie_word_embeddings={fields['tie_embeddings']}. Fix: --model.tie_embeddings=preset."
        )
    longest = model_cfg.max_seq_len
    if longest and longest != fields["max_seq_len"]:
        if arch != "decoder":  # GPT-2's learned table has the checkpoint's rows
            raise ConfigError(
                f"model.max_seq_len={longest} but model.init_from='{path}' has a learned "
                f"position table of {fields['max_seq_len']} rows. Fix: --model.max_seq_len=0."
            )
        fields["max_seq_len"] = longest  # RoPE: angles for any position
    spec = dataclasses.replace(spec, **fields)
    check_weights(spec, path)
    return spec


def check_weights(spec, path: str | Path) -> None:
    """Every parameter of our model has a tensor of the right shape in the checkpoint and
    every checkpoint tensor has a place in our model (checked on headers, before launch)."""
    from shardwise.models.decoder import Decoder
    from shardwise.models.init import canonical_name

    with torch.device("meta"):
        model = Decoder(spec)  # (init_from maps into our decoders: decoder or gpt2)
    reader = HFWeights(path, spec.arch)
    used, problems = set(), []
    for name, p in model.named_parameters():
        rule, key = rule_for(spec.arch, canonical_name(name, spec))
        used.add(key)
        if key not in reader.files:
            problems.append(f"'{key}' is missing")
            continue
        got = tuple(reader._slice(key).get_shape())
        if got != hf_shape(rule, tuple(p.shape)):
            problems.append(f"'{key}' has shape {got}, expected {hf_shape(rule, tuple(p.shape))}")
    extra = [k for k in reader.files if k not in used and not _IGNORED.search(k)]
    if spec.tie_embeddings:
        extra = [k for k in extra if k != "lm_head.weight"]  # a tied head saved anyway
    problems += [f"'{k}' has no place in shardwise's {spec.arch} model" for k in extra[:5]]
    reader.close()
    if problems:
        raise ConfigError(
            f"model.init_from='{path}' does not fit the model: "
            + "; ".join(problems[:8])
            + ". Fix: point init_from at a checkpoint of this architecture."
        )


@torch.no_grad()
def load_weights(model: torch.nn.Module, source: HFWeights, seed: int = 0) -> None:
    """Copy every parameter of a materialised model (whole, or tensor-parallel shards) from
    `source`."""
    from shardwise.models.init import (
        canonical_name,
        find_spec,
        initial_local,
        restore_buffers,
        take_buffers,
    )

    spec = find_spec(model)
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():  # a tied weight once
        cname = canonical_name(name, spec)
        if source.has(cname):
            p.copy_(source.local(cname, p))
        else:  # not in the checkpoint (a new head): from (seed, name), as without one
            owner, _, leaf = name.rpartition(".")
            p.copy_(initial_local(modules[owner], leaf, cname, p, seed, spec))
    take_buffers(model, source)  # persistent ones the checkpoint holds (a routing bias)
    source.close()
    restore_buffers(model)  # computed buffers (position ids, RoPE tables) lost on meta
