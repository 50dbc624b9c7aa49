"""`shardwise export` of a model directory that is not a shardwise run: a Hugging Face
Llama/GPT-2 directory to a PyTorch distributed checkpoint (DCP), and a model's DCP (ours, or
torchtitan's Llama layout, flat or under "model.") to Hugging Face safetensors.

Both read through the readers `model.init_from` uses (models/hf/weights.py, models/dcp.py),
so a DCP written from a Hugging Face directory holds exactly the tensors `model.init_from` of
that directory loads (in the directory's dtype), and a DCP's names, its torchtitan RoPE row
order and its shape (from the `model.*` keys: a DCP holds no config) are those
`model.init_from` of the DCP takes. OUT follows export_dir.py's rules.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

from shardwise.checkpoint import io as cio
from shardwise.checkpoint.export import check_hf_class, copy_tokenizer, hf_plan, write_weights
from shardwise.checkpoint.export_dir import writing
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.models import build_on_meta
from shardwise.models.dcp import DCPWeights, is_dcp, tensor_sizes, titan_name
from shardwise.models.hf.weights import (
    CONFIG,
    INDEX,
    MODEL_TYPES,
    HFWeights,
    check_weights,
    read_config,
    rule_for,
    spec_fields,
)
from shardwise.models.init import canonical_name
from shardwise.models.presets import PRESETS, ModelSpec, preset_of_arch

SHAPE = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len")
# a model DCP that no transformers class holds: nothing to convert it to
DCP_FIX = (
    "--model.name of a Llama-style or GPT-2 decoder (tiny, gpt2-tiny) if it holds one, or use "
    "the DCP as it is (dcp.load and model.init_from read it)"
)
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _hf_config(path: Path) -> dict | None:
    """The directory's config.json when it is a Hugging Face model's with weights beside it."""
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    weights = (path / INDEX).is_file() or any(path.glob("*.safetensors"))
    return cfg if isinstance(cfg, dict) and "model_type" in cfg and weights else None


def source_kind(path: str | Path) -> str:
    """What `path` is: "run" (a run, checkpoint.dir or checkpoint: export_source.py reads it,
    or says why not), "hf" (a Hugging Face model directory) or "dcp" (a model's DCP)."""
    p = Path(path)
    if (p / cio.INDEX).is_file() or (p / cio.LATEST).is_file() or cio.list_complete(p):
        return "run"
    if is_dcp(p):
        return "dcp"
    return "hf" if _hf_config(p) is not None else "run"


def _reworded(exc: ConfigError, path: Path) -> ShardwiseError:
    """A model.init_from reader's refusal, naming the directory the export was given (the
    user set no model.init_from)."""
    text = str(exc).replace(f"model.init_from='{path}'", f"'{path}'")
    return ShardwiseError(text.replace("model.init_from: ", ""))


def hf_dir_spec(path: Path) -> ModelSpec:
    """The spec `model.init_from=path` gives our decoder: config.json's shape, checked
    against the tensors (models/hf/weights.py adapt_spec, with no model.* override)."""
    model_type = (_hf_config(path) or {}).get("model_type")
    if model_type not in MODEL_TYPES:
        raise ShardwiseError(
            f"'{path}' holds a Hugging Face '{model_type}' model; export reads the ones "
            f"shardwise's decoders take ({', '.join(sorted(MODEL_TYPES))}). Fix: train it as "
            f"transformers' class with --model.name=hf --model.init_from={path}."
        )
    try:
        spec = ModelSpec(**spec_fields(read_config(path), path))
        check_weights(spec, path)
    except ConfigError as exc:
        raise _reworded(exc, path) from None
    return spec


def init_keys(spec: ModelSpec) -> list[str]:
    """The model.* keys that give `spec`'s shape to `model.init_from` of a DCP."""
    name = preset_of_arch(spec)  # any preset of its family
    keys = [f"--model.name={name}", *(f"--model.{k}={getattr(spec, k)}" for k in SHAPE)]
    if spec.head_dim_override:  # (0, the default, derives it)
        keys.append(f"--model.head_dim={spec.head_dim_override}")
    return [*keys, f"--model.tie_embeddings={str(spec.tie_embeddings).lower()}"]


def _not_carried(spec: ModelSpec) -> str | None:
    """What of the Hugging Face config a DCP (no config) leaves to the preset's values."""
    preset = PRESETS[init_keys(spec)[0].split("=", 1)[1]]
    lost = [
        f"{k}={getattr(spec, k)} (the preset's: {getattr(preset, k)})"
        for k in ("norm_eps", "rope_theta")
        if getattr(spec, k) != getattr(preset, k)
    ]
    if not lost:
        return None
    return (
        f"note: a DCP holds no config and there is no model.* key for {', '.join(lost)}: "
        "model.init_from of this DCP uses the preset's value; model.init_from of the Hugging "
        "Face directory keeps the checkpoint's"
    )


def _dcp_save(state: dict[str, torch.Tensor], out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # torch warns that it assumes one process: it is one
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=out, no_dist=True)


def export_hf_dir(path: str | Path, out: str | Path, *, overwrite: bool = False) -> list[str]:
    """Write `out/` (a DCP of our plain decoder's state dict) from the Hugging Face directory
    `path`, with its tokenizer files; returns the model.* keys that read it back."""
    path = Path(path)
    spec = hf_dir_spec(path)
    reader = HFWeights(path, spec.arch)
    state = {}
    for key, value in build_on_meta(spec).state_dict().items():  # a tied head under both names
        name = canonical_name(key, spec)
        stored = reader._slice(rule_for(spec.arch, name)[1]).get_dtype()  # header only
        dtype = _DTYPES.get(stored, torch.float32)
        # read as float32 (init_from's values), then back to the stored dtype: exact
        state[key] = reader.full(name, tuple(value.shape)).to(dtype).contiguous()
    reader.close()
    about = {"format": "dcp", "checkpoint": str(path), "step": None}
    with writing(out, about, {"the source model": path}, overwrite) as tmp:
        _dcp_save(state, tmp)
        copy_tokenizer(path, Path(tmp))
    note = _not_carried(spec)
    if note:
        print(note, file=sys.stderr)
    return init_keys(spec)


def _shape_hint(path: Path) -> str:
    """What the DCP's metadata tells of its shape (the head count is not in the weights)."""
    names = {}
    for key, (size, _) in tensor_sizes(path, "the checkpoint").items():
        mapped = titan_name(key)
        names[mapped[0] if mapped else key.removeprefix("model.")] = list(size)
    layers = {k.split(".")[1] for k in names if k.startswith("blocks.")}
    embed = names.get("embed.weight")
    if not embed:
        return "it holds no 'embed.weight' (nor torchtitan's 'tok_embeddings.weight')"
    return (
        f"its tensors give --model.n_layers={len(layers)} --model.vocab_size={embed[0]} "
        f"--model.dim={embed[1]}; the head counts are not in the weights"
    )


def dcp_spec(path: Path, overrides: list[str]) -> ModelSpec:
    """The spec `model.init_from=path` gives with the `model.*` keys `overrides`."""
    from shardwise.config import load_config, parse_overrides
    from shardwise.models.spec import spec_from_config

    keys = [k for k, _ in parse_overrides(overrides)]
    other = [k for k in keys if not k.startswith("model.") or k == "model.init_from"]
    if other:
        raise ShardwiseError(
            f"--{other[0]} does not apply to an export: only model.* keys (the model's shape) "
            "do. Fix: leave it out."
        )
    if not keys:
        raise ShardwiseError(
            f"'{path}' is a PyTorch distributed checkpoint, which holds no config: the model's "
            "shape must be given, as model.init_from of it takes it: --model.name (tiny for "
            "Llama, gpt2-tiny for GPT-2) and --model.n_layers, --model.dim, --model.n_heads, "
            f"--model.n_kv_heads, --model.ffn_dim, --model.vocab_size where the preset's "
            f"differ ({_shape_hint(path)}). Fix: e.g. shardwise export {path} --format hf OUT "
            "--model.name=tiny --model.n_layers=2 ..."
        )
    try:
        return spec_from_config(load_config(None, [*overrides, f"--model.init_from={path}"]))
    except ConfigError as exc:
        raise _reworded(exc, path) from None


def export_model_dcp(
    path: str | Path,
    out: str | Path,
    overrides: list[str],
    max_shard_bytes: int = 2 << 30,
    *,
    overwrite: bool = False,
) -> ModelSpec:
    """Write `out/` (Hugging Face safetensors + config.json) from the model DCP `path` of the
    shape `overrides` give; returns that spec."""
    path = Path(path)
    spec = dcp_spec(path, overrides)
    # before OUT is touched (and before its tensors are named by a class it has not)
    check_hf_class(spec, f"'{path}' read as {spec.arch} is", DCP_FIX)
    reader = DCPWeights(path, spec)
    plan = hf_plan(spec)
    shapes = {name: shape for parts in plan.values() for name, shape in parts}
    first = canonical_name(next(iter(plan.values()))[0][0], spec)  # the embedding

    def read(name: str) -> torch.Tensor:
        return reader.full(canonical_name(name, spec), shapes[name])

    dtype = str(reader.sizes[reader.keys[first][0]][1]).removeprefix("torch.")
    about = {"format": "hf", "checkpoint": str(path), "step": None}
    with writing(out, about, {"the source model": path}, overwrite) as tmp:
        write_weights(spec, plan, read, dtype, Path(tmp), max_shard_bytes)
        copy_tokenizer(path, Path(tmp))
    reader.close()
    return spec
