"""`shardwise export RUN_DIR --format hf OUT`: a checkpoint to Hugging Face safetensors.

Streams: the output is planned from the index (names, shapes, dtypes) into shards of at most
`max_shard_bytes`, then each shard is assembled tensor by tensor from the checkpoint's slices
(`export_source.Source`: its files verified against their checksums and held open, one
parameter at a time) and written into a temporary folder that replaces OUT at the end
(`export_dir.writing`); no more than one output shard and one parameter are in memory at
once, whatever the layout the run was trained in.
The fp32 master weights are exported when the run kept them apart from the (bf16/fp16)
parameters, else the parameters. `config.json` describes the Llama or GPT-2 model (the MoE
decoder as Qwen2-MoE or GLM-4-MoE, where one computes the same: models/hf/qwen2_moe.py,
glm4_moe.py) so `transformers`' `from_pretrained(OUT)` loads it; the tensor layouts are those
of shardwise.models.hf.gpt2 (transposed Conv1D and fused c_attn for GPT-2) and qwen2_moe
(stacked experts).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from shardwise.checkpoint.export_dir import writing
from shardwise.checkpoint.export_source import Source, open_source
from shardwise.checkpoint.refusals import check_base
from shardwise.errors import ShardwiseError
from shardwise.finetune.lora import ADAPTER, apply_lora, is_adapter_name
from shardwise.models import build_on_meta
from shardwise.models.expert_lora import adapted_weights, merged_delta
from shardwise.models.families import Family, family_of
from shardwise.models.hf.rule import hf_shape
from shardwise.models.hf.weights import INDEX, SINGLE, rule_for
from shardwise.models.init import canonical_name
from shardwise.models.presets import ModelSpec

# what `check_hf_class`'s callers with a run or checkpoint suggest instead
TO_DCP = "--format dcp (its state dict as a PyTorch distributed checkpoint)"


def check_hf_class(spec: ModelSpec, given: str, fix: str = TO_DCP) -> Family:
    """Refuse a family without a transformers class to write (a ResNet, your own module):
    callers check before OUT is touched; `given` names the source as the user gave it.
    Returns the family."""
    family = family_of(spec)
    if family.hf_config is None and not family.from_checkpoint:
        raise ShardwiseError(
            f"{given} {family.kind}, and --format hf writes transformers classes only (the "
            f"Llama-style, GPT-2 and MoE decoders and Hugging Face models). Fix: {fix}."
        )
    return family


def hf_config(spec: ModelSpec, dtype: str) -> dict:
    """config.json for transformers, with the model's dropout rates (models/hf/llama.py,
    gpt2.py); a checkpoint's own class keeps its config, labels and tokenizer."""
    family = check_hf_class(spec, f"the model '{spec.arch}' is")
    if family.from_checkpoint:
        from shardwise.models.hf.auto import export_config

        return export_config(spec, dtype)
    return family.hf_config(spec, dtype)


def hf_plan(spec: ModelSpec, finetune=None) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Hugging Face tensor -> our parameters (name, shape) that make it up, in part order (a
    LoRA run's adapted layers under their base names: the adapters are merged in on read)."""
    model = build_on_meta(spec)
    if finetune is not None:
        apply_lora(model, finetune)
    out: dict[str, list] = {}
    for name, p in model.named_parameters():  # a tied head is the embedding, once
        if is_adapter_name(name):
            continue
        rule, key = rule_for(spec.arch, canonical_name(name, spec))
        out.setdefault(key, [None] * rule.parts)[rule.part] = (name, tuple(p.shape))
    return out


def _assemble(spec: ModelSpec, parts: list, read) -> torch.Tensor:
    """The Hugging Face tensor from our parameters (`read(name)` gives one at full shape)."""
    pieces = [read(name) for name, _ in parts]
    rule, _ = rule_for(spec.arch, canonical_name(parts[0][0], spec))
    if rule.stacked:  # experts [E, in, out] -> [E, out, in], parts along their out axis
        return torch.cat([p.transpose(1, 2) for p in pieces], 1).contiguous()
    full = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
    return full.t().contiguous() if rule.transposed else full


def _shards(spec: ModelSpec, plan: dict, elem: int, max_bytes: int) -> list[list[str]]:
    """Hugging Face tensor names grouped into files of at most `max_bytes` (from shapes)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, parts in plan.items():
        rule, _ = rule_for(spec.arch, canonical_name(parts[0][0], spec))
        nbytes = elem * math.prod(hf_shape(rule, parts[0][1]))
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def copy_tokenizer(source: Path, out: Path) -> None:
    """The checkpoint's tokenizer files beside the exported weights (from_pretrained(OUT))."""
    import shutil

    from shardwise.data.pretrained import FILES

    for name in FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)


def _write_tokenizer(cfg, spec, out: Path) -> None:
    """The tokenizer the run trained with, and a generation config with its end-of-text id,
    so `pipeline("text-generation", OUT)` turns text into the model's ids and stops."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from shardwise.data import data_spec
    from shardwise.data.tokens import prepare_text

    ds = data_spec(cfg, spec.vocab_size, family_of(spec).classifier)
    if ds.dataset == "digits" or ds.label_field:
        return  # images, or a classifier's labels: no text generation
    if ds.tokenizer:  # the checkpoint's own (or data.tokenizer's) files, as they are
        copy_tokenizer(Path(ds.tokenizer), out)
        return
    cache, meta = prepare_text(ds)  # shardwise's BPE lives beside the run's token cache
    tok = PreTrainedTokenizerFast(tokenizer_file=str(cache / "tokenizer.json"))
    eos = tok.convert_ids_to_tokens(meta["eos_id"])
    tok.add_special_tokens({"eos_token": eos})
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=meta["eos_id"], pad_token_id=meta["eos_id"]).save_pretrained(out)


def _quantised_base(cfg, spec) -> dict[str, torch.Tensor]:
    """A QLoRA run's base linears as it computed with them: quantised to NF4 from the values it
    started from (checkpoints do not store them; finetune/quant.py), dequantised; by name."""
    from shardwise.finetune import build_adapted
    from shardwise.finetune.quant import materialise_quantised, quant_layers
    from shardwise.models.hf.auto import weights_for

    model = build_adapted(spec, cfg.finetune)[0]
    source = weights_for(spec, cfg.model.init_from, model)
    materialise_quantised(model, source, cfg.train.seed, torch.device("cpu"))
    return {f"{path}.weight": layer.dequantised() for path, layer in quant_layers(model)}


def _adapted_experts(cfg, spec) -> dict[str, bool]:
    """A LoRA run's adapted stacked expert weights by name -> their layout (`in_out`)."""
    if not cfg.finetune.lora_rank:
        return {}
    model = build_on_meta(spec)
    apply_lora(model, cfg.finetune)
    return adapted_weights(model)


def merging(read, cfg, spec):
    """`read`, with a LoRA layer's base weight read as W + (alpha / r)·B·A (peft's merge); a
    quantised base (QLoRA) is the dequantised NF4 weight the run trained against."""
    scale = cfg.finetune.lora_alpha / max(cfg.finetune.lora_rank, 1)
    suffix = ".base_layer.weight"
    quantised = _quantised_base(cfg, spec) if cfg.finetune.base_quant != "none" else {}
    experts = _adapted_experts(cfg, spec)

    def merged(name: str) -> torch.Tensor:
        w = quantised[name] if name in quantised else read(name)
        if name in experts:  # stacked expert weights: a pair per expert
            path, _, leaf = name.rpartition(".")
            a, b = read(f"{path}.lora_A.{leaf}"), read(f"{path}.lora_B.{leaf}")
            return (w.float() + merged_delta(a, b, scale, experts[name])).to(w.dtype)
        if not name.endswith(suffix) or not cfg.finetune.lora_rank:
            return w
        layer = name[: -len(suffix)]
        a = read(f"{layer}.lora_A.{ADAPTER}.weight").float()
        b = read(f"{layer}.lora_B.{ADAPTER}.weight").float()
        delta = b @ a * scale  # [out, in]; a Conv1D base stores [in, out]
        delta = delta if delta.shape == w.shape else delta.t()
        return (w.float() + delta).to(w.dtype)

    return merged


def _write(src: Source, out: Path, max_shard_bytes: int) -> None:
    """The Hugging Face files of `src` in `out` (a fresh folder)."""
    cfg, spec, index = src.cfg, src.spec, src.index
    plan = hf_plan(spec, cfg.finetune)
    first = canonical_name(next(iter(plan.values()))[0][0], spec)  # the embedding
    kind = "master" if f"master/{first}" in index["tensors"] else "param"
    dtype = index["tensors"][f"{kind}/{first}"]["dtype"]
    check = family_of(spec).hf_check
    names = [k for k in index["tensors"] if k.startswith("buffer/")]
    buffers = {k.removeprefix("buffer/"): src.tensor(k) for k in names}
    if check is not None:  # before any file: a refusal leaves OUT as it was
        for note in check(spec, buffers):
            print(f"note: {note}", file=sys.stderr)
    extra = hf_extra(spec, buffers, dtype)  # (before any file too: its refusals as well)
    read = merging(src.read, cfg, spec)
    write_weights(spec, plan, read, dtype, out, max_shard_bytes, extra)
    write_tokenizer(cfg, spec, out)


def hf_extra(spec: ModelSpec, buffers: dict, dtype: str) -> dict[str, torch.Tensor]:
    """The tensors the exported class holds and no parameter of ours does (`Family.hf_extra`),
    from the run's `buffers` by name; {} for a family without any."""
    family = family_of(spec)
    return family.hf_extra(spec, buffers, dtype) if family.hf_extra is not None else {}


def write_weights(
    spec: ModelSpec,
    plan: dict,
    read,
    dtype: str,
    out: Path,
    max_shard_bytes: int,
    extra: dict | None = None,
) -> None:
    """Safetensors shards (+ index) and config.json in `out` for the model `spec`, each tensor
    assembled from our parameters (`plan`: `hf_plan`; `read(name)` gives one at full shape;
    `extra`: the class's own tensors, `hf_extra`'s, made from no buffers when not given)."""
    from safetensors.torch import save_file

    shards = _shards(spec, plan, getattr(torch, dtype).itemsize, max_shard_bytes)
    extra = hf_extra(spec, {}, dtype) if extra is None else extra
    weight_map, total = {}, 0
    for i, keys in enumerate(shards):  # one output file in memory at a time
        fname = (
            SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {key: _assemble(spec, plan[key], read).to(getattr(torch, dtype)) for key in keys}
        if i == len(shards) - 1:  # the class's own tensors (few and small) in the last file
            tensors.update(extra)  # each in the dtype its class keeps it in
            keys = list(tensors)
        save_file(tensors, out / fname, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(keys, fname))
        del tensors
    if len(shards) > 1:
        index_out = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index_out, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(spec, dtype), indent=2))


def write_tokenizer(cfg, spec, out: Path) -> None:
    """The tokenizer of the run beside its exported weights: a checkpoint's own files, or
    the one the run trained with (so `model.init_from=OUT` and from_pretrained(OUT) read text
    as the model was trained to)."""
    if family_of(spec).from_checkpoint:
        copy_tokenizer(Path(spec.source), out)
    else:
        _write_tokenizer(cfg, spec, out)


def export_hf(
    run_dir: str | Path,
    out: str | Path,
    max_shard_bytes: int = 2 << 30,
    *,
    step: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `out/` (safetensors shards + index + config.json) from the run's newest
    checkpoint, or that of `step` (LoRA adapters merged into their layers), replacing an
    earlier export there whole (export_dir.py); returns the checkpoint exported."""
    with open_source(run_dir, step) as src:
        check_base(src.index, src.cfg, src.path)  # a quantised base changed since the save
        # before OUT is touched, not half-way through naming its tensors
        check_hf_class(
            src.spec, f"the run in '{src.given}' trained model.name='{src.cfg.model.name}',"
        )
        about = {"format": "hf", "checkpoint": str(src.path), "step": src.index["step"]}
        with writing(out, about, src.protected(), overwrite) as tmp:
            _write(src, tmp, max_shard_bytes)
        spec = src.spec
    family = family_of(spec)
    if family.hf_config is not None and not family.hf_keeps_dropout and spec.dropout > 0:
        print(
            f"note: model.dropout={spec.dropout} (embedding and residual dropout) is not in the "
            "exported config: transformers' Llama, Qwen2-MoE and GLM-4-MoE have attention "
            f"dropout only (attention_dropout={spec.attn_dropout} is)",
            file=sys.stderr,
        )
    return src.path
