"""`shardwise export RUN_DIR --format peft OUT`: a LoRA run's adapter as peft saves one.

`OUT/adapter_config.json` (peft's own LoraConfig, saved by peft) and
`OUT/adapter_model.safetensors` with peft's key names (`base_model.model.<layer>.lora_A.weight`,
the adapter name dropped; a new classification head as `modules_to_save`), so
`peft.PeftModel.from_pretrained(base, OUT)` loads it onto the base model: the checkpoint the
run started from (`model.name=hf`), or for a built-in Llama-style decoder the Hugging Face
model `--format hf` writes of its base. Each adapter tensor is read whole from the checkpoint
slices of whatever layout trained it; nothing of the frozen base is read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.checkpoint.export_dir import writing
from shardwise.checkpoint.export_source import Source, open_source
from shardwise.errors import ShardwiseError
from shardwise.finetune.lora import ADAPTER, apply_lora
from shardwise.models import build_on_meta
from shardwise.models.expert_lora import adapted_weights
from shardwise.models.families import family_of
from shardwise.models.hf.weights import rule_for
from shardwise.models.init import canonical_name
from shardwise.optim import quiet_bitsandbytes


def _their_path(spec, layer: str) -> str:
    """The Hugging Face module path of our layer `layer`."""
    if family_of(spec).from_checkpoint:  # transformers' own names
        return layer
    rule, key = rule_for(spec.arch, canonical_name(f"{layer}.weight", spec))
    if rule.parts > 1 or rule.transposed:
        raise ShardwiseError(
            f"'{layer}' is part of a fused or transposed Hugging Face layer ({key}) in a "
            f"{spec.arch} model, which a peft adapter cannot address. Fix: --format hf (the "
            "adapters merged into the weights)."
        )
    return key.removesuffix(".weight")


def _adapter(src: Source) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(peft's tensors by name, the adapted layers' paths, the heads trained whole)."""
    spec, ft = src.spec, src.cfg.finetune
    model = build_on_meta(spec)
    layers = apply_lora(model, ft)
    experts = adapted_weights(model)
    if experts:
        raise ShardwiseError(
            f"the run's adapters include stacked expert weights ({next(iter(experts))}, ...; "
            f"finetune.lora_targets='{ft.lora_targets}'), which shardwise keeps as a pair per "
            "expert and a peft adapter file does not hold. Fix: --format hf (the adapters "
            "merged into the weights)."
        )
    tensors, paths = {}, []
    for layer in layers:
        theirs = _their_path(spec, layer)
        paths.append(theirs)
        for part in ("lora_A", "lora_B"):
            value = src.read(f"{layer}.{part}.{ADAPTER}.weight").float().contiguous()
            tensors[f"base_model.model.{theirs}.{part}.weight"] = value
    heads = sorted({n.rpartition(".")[0] for n, p in model.named_parameters() if p.requires_grad})
    heads = [h for h in heads if not any(f".{part}." in f"{h}." for part in ("lora_A", "lora_B"))]
    for name, p in model.named_parameters():  # a new head, trained whole
        if p.requires_grad and name.rpartition(".")[0] in heads:
            tensors[f"base_model.model.{name}"] = src.read(name).float().contiguous()
    return tensors, paths, heads


def export_peft(
    run_dir: str | Path, out: str | Path, *, step: int | None = None, overwrite: bool = False
) -> Path:
    """Write the adapter of the run's newest checkpoint (or that of `step`) to `out/`,
    replacing an earlier export there whole (export_dir.py); returns the checkpoint."""
    from safetensors.torch import save_file

    quiet_bitsandbytes()  # peft imports it when installed
    from peft import LoraConfig

    with open_source(run_dir, step) as src:
        ft = src.cfg.finetune
        if ft.lora_rank == 0:
            raise ShardwiseError(
                f"the run in '{run_dir}' trained no LoRA adapter (finetune.lora_rank=0). Fix: "
                "--format dcp exports its whole model (--format hf too, for a model with a "
                "transformers class)."
            )
        tensors, paths, heads = _adapter(src)
        about = {"format": "peft", "checkpoint": str(src.path), "step": src.index["step"]}
        with writing(out, about, src.protected(), overwrite) as tmp:
            LoraConfig(
                r=ft.lora_rank,
                lora_alpha=ft.lora_alpha,
                lora_dropout=ft.lora_dropout,
                target_modules=paths,
                modules_to_save=heads or None,
                task_type="SEQ_CLS" if family_of(src.spec).classifier else "CAUSAL_LM",
                base_model_name_or_path=src.cfg.model.init_from or None,
            ).save_pretrained(tmp)
            save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    return src.path
