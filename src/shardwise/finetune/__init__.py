"""Fine-tuning conversions applied to the model on meta, before parallelisation: LoRA adapters
through peft (lora.py) and a frozen NF4 base under them, QLoRA, through bitsandbytes
(quant.py). The 8-bit optimizer is optim.py's (optim.name=adamw8bit)."""

from __future__ import annotations

from torch import nn

from shardwise.config import FinetuneConfig
from shardwise.models import ModelSpec, build_on_meta


def build_adapted(spec: ModelSpec, ft: FinetuneConfig) -> tuple[nn.Module, list[str]]:
    """The model as every rank builds it before parallelising, on meta: LoRA adapters added
    (the base frozen), a quantised base's weights no longer parameters. Training, the
    pre-launch checks and the planner all start from this one function, so what they check
    and price is what the ranks load. Returns the model and the quantised layers' paths."""
    from shardwise.finetune.lora import apply_lora
    from shardwise.finetune.quant import quantise_base

    model = build_on_meta(spec)
    apply_lora(model, ft)
    return model, quantise_base(model, ft.base_quant, ft.lora_targets)
