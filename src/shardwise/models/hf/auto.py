"""Any model `transformers` builds from a checkpoint's config.json: `model.name=hf` with
`model.init_from=DIR`, trained under its own module names.

`model.task=causal_lm` builds `AutoModelForCausalLM`, `classification` builds
`AutoModelForSequenceClassification` with one output per label of the data (its new head
starts from (train.seed, name) like every parameter the checkpoint lacks). The model is built on
meta (models/custom.py `on_meta`), then each rank reads from the safetensors only the slices it
keeps, and its persistent buffers (a routing bias) whole (models/hf/buffers.py); ZeRO cuts it
into units at its repeated block class (`_no_split_modules`). Dropout is switched off:
transformers draws its masks from torch's global generator, so they would depend on the
layout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.hf.weights import CONFIG, HFWeights, checkpoint_dir
from shardwise.models.packing import take_packed_tokens

TASKS = {
    "causal_lm": "AutoModelForCausalLM",
    "classification": "AutoModelForSequenceClassification",
}


def import_transformers():
    """The `transformers` module (an optional dependency), or one message naming the fix."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "Hugging Face models (model.name=hf, hf-llama, hf-gpt2, ...) are built with the "
            "`transformers` package, which is not installed. Fix: pip install -c "
            "constraints.txt -e '.[dev]'"
        ) from None
    return transformers


def read_hf_config(path: str):
    """The checkpoint's config as transformers reads it, or one message naming the fix."""
    if not path:
        raise ConfigError(
            "model.name=hf needs model.init_from=DIR, a folder that save_pretrained wrote. "
            "Fix: --model.init_from=path/to/checkpoint."
        )
    p = checkpoint_dir(path)
    tf = import_transformers()
    try:
        return tf.AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # unknown model_type, malformed json, ...
        kind = json.loads((p / CONFIG).read_text()).get("model_type", "?")
        raise ConfigError(
            f"model.init_from='{path}': transformers {tf.__version__} cannot build its "
            f"'{kind}' config ({type(exc).__name__}: {str(exc)[:200]}). Fix: a model type this "
            "transformers version knows, or upgrade transformers."
        ) from None


def training_config(spec):
    """The checkpoint's config with dropout off, no KV cache and the labels of the task."""
    config = read_hf_config(spec.source)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is None:
            continue
        for key, value in list(vars(holder).items()):
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
                setattr(holder, key, 0.0)
    config.use_cache = False
    # MoE classes: shardwise trains on the LM loss of the logits alone (docs/moe.md), so the
    # router logits transformers would gather for its aux loss are not asked for
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False
    if spec.task == "classification":
        config.num_labels = len(spec.labels)
        config.id2label = dict(enumerate(spec.labels))
        config.label2id = {name: i for i, name in enumerate(spec.labels)}
    return config


def build_auto(spec) -> nn.Module:
    """The transformers model of `spec` (meta under `torch.device("meta")`)."""
    from shardwise.models.custom import on_meta
    from shardwise.models.hf.experts import use_shardwise_experts

    tf = import_transformers()
    config = training_config(spec)
    cls = getattr(tf, TASKS[spec.task])
    model = on_meta(lambda: cls.from_config(config))
    use_shardwise_experts(model)  # MoE classes: stacked experts through our expert matmul
    if spec.task == "classification":
        _take_packed_inputs(model)
    else:  # data.pack=true: records packed in rows (models/packing.py)
        take_packed_tokens(model)
    model.shardwise_spec = spec  # (on_meta kept the buffers its constructor computed: RoPE tables)
    return model


def _take_packed_inputs(model: nn.Module) -> None:
    """The classification data packs ids and attention mask as [B, 2, S] (one tensor per
    batch side, as every dataset's get_batch returns); the forward unpacks them and returns
    the logits. An instance attribute: module names do not change."""
    inner = model.forward

    def forward(packed: torch.Tensor) -> torch.Tensor:
        return inner(input_ids=packed[:, 0], attention_mask=packed[:, 1]).logits

    model.forward = forward


class AutoWeights(HFWeights):
    """Reads parameters by their own names from the checkpoint's safetensors, any row range at
    a time. Checkpoint keys are renamed as transformers renames them on load (its conversion
    mapping: `embed_out` -> `lm_head`, legacy `gamma`/`beta`, ...); a checkpoint of the bare
    model (BertModel) serves a model with a head (its names under `bert.`) and the other way
    round; a parameter the checkpoint does not hold (a new head) is `has() == False`.

    Mixture-of-experts classes (Mixtral, Qwen2/3-MoE, OLMoE) hold each layer's experts as one
    stacked parameter [E, ...] that checkpoints store as one tensor per expert: such a
    parameter's row e (dim 0) is expert e's tensors, concatenated as transformers' loader
    concatenates them, so a rank still reads only the experts its rows cover."""

    def __init__(self, path: str | Path, model: nn.Module) -> None:
        super().__init__(path, "hf")
        prefix = getattr(model, "base_model_prefix", "")
        self.prefix = f"{prefix}." if prefix else ""
        # model name -> checkpoint key; stacked experts: name -> (concat dim, [part][expert] keys)
        self.names, self.stacked = _renamed(model, list(self.files), path)

    def _name(self, name: str) -> str | None:
        p = self.prefix
        for candidate in (name, name[len(p) :] if p and name.startswith(p) else None, p + name):
            if candidate in self.names or candidate in self.stacked:
                return candidate
        return None

    def key(self, name: str) -> str | None:
        """The checkpoint key of `name` (of a stacked parameter: its first expert's first)."""
        found = self._name(name)
        if found is None:
            return None
        return self.names[found] if found in self.names else self.stacked[found][1][0][0]

    def has(self, name: str) -> bool:
        return self._name(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape the checkpoint gives parameter `name` (stacked experts: [E, ...])."""
        found = self._name(name)
        if found in self.names:
            return tuple(self._slice(self.names[found]).get_shape())
        dim, parts = self.stacked[found]
        shapes = [[tuple(self._slice(k).get_shape()) for k in keys] for keys in parts]
        one = list(shapes[0][0])
        one[dim] = sum(s[0][dim] for s in shapes)
        if any(s != shapes[0] for s in shapes) or any(len(set(s)) > 1 for s in shapes):
            return (-1,)  # experts of unequal shapes or counts: no stacked parameter fits
        return (len(parts[0]), *one)

    def whole(self, name: str) -> torch.Tensor:
        """The checkpoint's tensor `name` whole, in its stored dtype (a persistent buffer)."""
        return self._slice(self.names[self._name(name)])[:]

    def buffers(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The persistent buffers `model` holds (GLM-4-MoE's routing biases), read whole."""
        from shardwise.models.hf.buffers import read_buffers

        return read_buffers(model, self)

    def rows(self, name: str, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
        found = self._name(name)
        if found in self.names:
            return self._slice(self.names[found])[r0:r1].float().contiguous()
        dim, parts = self.stacked[found]
        experts = [
            torch.cat([self._slice(keys[e])[:] for keys in parts], dim) for e in range(r0, r1)
        ]
        return torch.stack(experts).float().contiguous()


def _renamed(model: nn.Module, keys: list[str], path) -> tuple[dict, dict]:
    """The model's name for each checkpoint key, as transformers' loader renames it, and the
    stacked expert parameters it merges from one tensor per expert (`_stacking`); a key that
    needs any other conversion is refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    try:
        transforms = get_model_conversion_mapping(model)
    except Exception:  # a plain (non-PreTrainedModel) module: names as they are
        transforms = []
    out: dict[str, str] = {}
    stacked: dict[str, tuple[int, list[dict[int, str]]]] = {}
    for key in keys:
        name = key
        for transform in transforms:
            renamed, matched = transform.rename_source_key(name)
            if matched is None:
                continue
            if isinstance(transform, WeightRenaming):
                name = renamed
                continue
            dim = _stacking(transform)
            expert = re.search(re.escape(matched).replace(r"\*", r"(\d+)"), name)
            if dim is None or expert is None:
                raise ConfigError(
                    f"model.init_from='{path}': tensor '{key}' needs transformers' "
                    f"{type(transform).__name__} conversion, which shardwise does not apply "
                    "slice by slice. Fix: a checkpoint saved in the model's own layout."
                )
            part = transform.source_patterns.index(matched)
            slot = stacked.setdefault(renamed, (dim, [{} for _ in transform.source_patterns]))
            slot[1][part][int(expert.group(1))] = key
            name = None
            break
        if name is not None:
            out[name] = key
    return out, {
        name: (dim, _in_order(name, parts, path)) for name, (dim, parts) in stacked.items()
    }


def _stacking(transform) -> int | None:
    """For transformers' expert merge (each expert's tensors stacked on a new dim 0, parts
    then concatenated along dim d >= 1), the dim d - 1 along which one expert's parts join;
    None for any other conversion."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(getattr(transform, "operations", []))
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
        return None
    if len(ops) == 1:
        return 0
    if len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
        return ops[1].dim - 1
    return None


def _in_order(name: str, parts: list[dict[int, str]], path) -> list[list[str]]:
    """Each part's keys by expert number, refused unless every part has experts 0..E-1."""
    count = len(parts[0])
    if any(sorted(p) != list(range(count)) for p in parts):
        raise ConfigError(
            f"model.init_from='{path}': the experts stacked into '{name}' are not numbered "
            f"0..{count - 1} in every part ({[sorted(p) for p in parts]}). Fix: the checkpoint "
            "as save_pretrained wrote it."
        )
    return [[p[e] for e in range(count)] for p in parts]


def weight_source(spec, model: nn.Module) -> AutoWeights:
    return AutoWeights(spec.source, model)


def weights_for(spec, init_from: str, model: nn.Module) -> HFWeights | None:
    """Where a run's parameter values come from: Hugging Face weights read slice by slice
    (transformers' own names for model.name=hf, a new head from (seed, name)), or None: the
    (seed, name) init."""
    if spec.arch == "hf":
        return weight_source(spec, model)
    if init_from:
        from shardwise.models.dcp import DCPWeights, is_dcp

        return DCPWeights(init_from, spec) if is_dcp(init_from) else HFWeights(init_from, spec.arch)
    return None


def check_checkpoint(spec) -> list[str]:
    """Before launch: the parameters the checkpoint does not hold (they start from (seed,
    name)); refused when it holds none of them, a tensor of the wrong shape, or misses a
    persistent buffer (models/hf/buffers.py)."""
    from shardwise.models.hf.buffers import check_buffers, check_shape

    with torch.device("meta"):
        model = build_auto(spec)
    source = weight_source(spec, model)
    missing = []
    for name, p in model.named_parameters():
        if source.key(name) is None:
            missing.append(name)
            continue
        check_shape(spec, source, name, tuple(p.shape))
    total = sum(1 for _ in model.parameters())
    if len(missing) == total:
        raise ConfigError(
            f"model.init_from='{spec.source}': none of the model's {total} parameters is in "
            "its safetensors (names do not match). Fix: the checkpoint saved with this config."
        )
    check_buffers(spec, model, source)  # (after: a checkpoint of another model is named so)
    source.close()
    return missing


def export_config(spec, dtype: str) -> dict:
    """config.json of the trained model: the checkpoint's own (its dropout as it was), the
    class trained (`architectures`) and, for classification, the label names."""
    config = read_hf_config(spec.source)
    if spec.task == "classification":
        config.num_labels = len(spec.labels)
        config.id2label = dict(enumerate(spec.labels))
        config.label2id = {name: i for i, name in enumerate(spec.labels)}
    with torch.device("meta"):
        config.architectures = [type(build_auto(spec)).__name__]
    out = config.to_dict()
    out["dtype"] = dtype
    return out
