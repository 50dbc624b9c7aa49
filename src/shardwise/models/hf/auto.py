"""Any model `transformers` builds from a checkpoint's config.json: `model.name=hf` with
`model.init_from=DIR`, trained under its own module names.

`model.task=causal_lm` builds `AutoModelForCausalLM`, `classification` builds
`AutoModelForSequenceClassification` with one output per label of the data (its new head
starts from (train.seed, name) like every parameter the checkpoint lacks). The model is built on
meta (models/custom.py `on_meta`), then each rank reads from the safetensors only the slices it
keeps; ZeRO cuts it into units at its repeated block class (`_no_split_modules`). Dropout is
switched off: transformers draws its masks from torch's global generator, so they would
depend on the layout.
"""

from __future__ import annotations

import json
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


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model.name=hf builds the model with `transformers`. Fix: pip install -c "
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
    tf = _transformers()
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
    if spec.task == "classification":
        config.num_labels = len(spec.labels)
        config.id2label = dict(enumerate(spec.labels))
        config.label2id = {name: i for i, name in enumerate(spec.labels)}
    return config


def build_auto(spec) -> nn.Module:
    """The transformers model of `spec` (meta under `torch.device("meta")`)."""
    from shardwise.models.custom import on_meta

    tf = _transformers()
    config = training_config(spec)
    cls = getattr(tf, TASKS[spec.task])
    model = on_meta(lambda: cls.from_config(config))
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
    round; a parameter the checkpoint does not hold (a new head) is `has() == False`."""

    def __init__(self, path: str | Path, model: nn.Module) -> None:
        super().__init__(path, "hf")
        prefix = getattr(model, "base_model_prefix", "")
        self.prefix = f"{prefix}." if prefix else ""
        self.names = _renamed(model, list(self.files), path)  # model name -> checkpoint key

    def key(self, name: str) -> str | None:
        p = self.prefix
        for candidate in (name, name[len(p) :] if p and name.startswith(p) else None, p + name):
            if candidate in self.names:
                return self.names[candidate]
        return None

    def has(self, name: str) -> bool:
        return self.key(name) is not None

    def rows(self, name: str, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
        sl = self._slice(self.key(name))
        return sl[r0:r1].float().contiguous()


def _renamed(model: nn.Module, keys: list[str], path) -> dict[str, str]:
    """The model's name for each checkpoint key, as transformers' loader renames it; a key
    that needs a conversion beyond renaming (fused or split experts) is refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    try:
        transforms = get_model_conversion_mapping(model)
    except Exception:  # a plain (non-PreTrainedModel) module: names as they are
        transforms = []
    out = {}
    for key in keys:
        name = key
        for transform in transforms:
            renamed, matched = transform.rename_source_key(name)
            if matched is None:
                continue
            if not isinstance(transform, WeightRenaming):
                raise ConfigError(
                    f"model.init_from='{path}': tensor '{key}' needs transformers' "
                    f"{type(transform).__name__} conversion, which shardwise does not apply "
                    "slice by slice. Fix: a checkpoint saved in the model's own layout."
                )
            name = renamed
        out[name] = key
    return out


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
    name)); refused when it holds none of them or a tensor of the wrong shape."""
    with torch.device("meta"):
        model = build_auto(spec)
    source = weight_source(spec, model)
    missing = []
    for name, p in model.named_parameters():
        key = source.key(name)
        if key is None:
            missing.append(name)
            continue
        shape = tuple(source._slice(key).get_shape())
        if shape != tuple(p.shape):
            raise ConfigError(
                f"model.init_from='{spec.source}': '{key}' has shape {list(shape)} but the "
                f"model's '{name}' is {list(p.shape)}. Fix: the checkpoint of this config."
            )
    source.close()
    total = sum(1 for _ in model.parameters())
    if len(missing) == total:
        raise ConfigError(
            f"model.init_from='{spec.source}': none of the model's {total} parameters is in "
            "its safetensors (names do not match). Fix: the checkpoint saved with this config."
        )
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
