"""A frozen low-bit base (`finetune.base_quant=nf4`): QLoRA (Dettmers et al. 2023, "QLoRA:
Efficient Finetuning of Quantized LLMs"), through bitsandbytes.

The base linear of every LoRA layer becomes a `QuantLinear`: its weight is stored as
bitsandbytes' 4-bit NormalFloat with double quantisation (blocks of 64 weights, the absmax of
each block itself quantised to 8 bits in groups of 256) and multiplied by `bnb.matmul_4bit`,
which dequantises on the fly and again in backward (only the input's gradient is taken: the
weight is frozen), so no 16/32-bit copy of the weight is kept between forward and backward.
bitsandbytes over torchao: it runs NF4 on CPU and on CUDA alike with one call each way (torchao's
NF4 tensor compiles kernels on first use), and peft already speaks its formats.

Values: each rank computes the weight exactly as an unquantised run would (the checkpoint's
tensor, or the (seed, name) init) and quantises it, identically on every rank, so every data
parallel layout trains against bit-identical base weights. The packed weight and its statistics
are non-persistent buffers: checkpoints do not store them (a resumed run quantises again, to the
same bits), and ZeRO units (parameters only) never hold them, so a quantised weight is never put
into a float flat buffer. ZeRO-1/2 and data parallelism keep the whole quantised base on every
rank; ZeRO-3 sharding of it, tensor and pipeline parallelism are refused for now.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.finetune.lora import is_lora_layer
from shardwise.optim import quiet_bitsandbytes

NF4_BLOCK = 64  # weights per absmax block (QLoRA's choice)
STATE_KEYS = ("weight_q", "absmax", "code", "absmax2", "code2")


def _bnb():
    quiet_bitsandbytes()
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bf
    except ImportError:
        raise ConfigError(
            "finetune.base_quant=nf4 stores the frozen base with bitsandbytes, which is not "
            "installed. Fix: pip install 'shardwise[finetune]' (or bitsandbytes), or "
            "--finetune.base_quant=none."
        ) from None
    return bnb, bf


class QuantLinear(nn.Module):
    """A frozen linear layer whose weight is held in NF4 (buffers set by `quantise_weight`);
    the bias, if any, stays a (frozen) parameter."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.state = None  # bitsandbytes' QuantState, rebuilt from the buffers
        for key in STATE_KEYS:
            self.register_buffer(key, None, persistent=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @torch.no_grad()
    def quantise_weight(self, value: torch.Tensor) -> None:
        """Store `value` ([out, in], any float dtype) in NF4 with double quantisation."""
        _, bf = _bnb()
        q, state = bf.quantize_4bit(
            value.float().contiguous(),
            blocksize=NF4_BLOCK,
            compress_statistics=True,
            quant_type="nf4",
        )
        state.dtype = torch.float32  # dequantised to fp32; cast to the input's dtype on use
        self.weight_q, self.absmax, self.code = q, state.absmax, state.code
        self.absmax2, self.code2 = state.state2.absmax, state.state2.code
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bnb, _ = _bnb()
        if self.state is None:
            raise RuntimeError("QuantLinear used before its weight was quantised")
        self.state.dtype = x.dtype
        y = bnb.matmul_4bit(x, self.weight_q.t(), quant_state=self.state)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantised(self) -> torch.Tensor:
        _, bf = _bnb()
        return bf.dequantize_4bit(self.weight_q, self.state).float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4"


def quantise_base(model: nn.Module, base_quant: str) -> list[str]:
    """Replace the base layer of every LoRA layer by a QuantLinear (on meta: shapes only);
    returns their paths (`...wq.base_layer`)."""
    if base_quant == "none":
        return []
    if base_quant != "nf4":
        raise ConfigError(
            f"finetune.base_quant={base_quant}: train quantises the base to nf4 only so far. "
            "Fix: --finetune.base_quant=nf4, or none."
        )
    _bnb()
    done = []
    for path, module in list(model.named_modules()):
        base = getattr(module, "base_layer", None)
        if is_lora_layer(module) and isinstance(base, nn.Linear):
            module.base_layer = QuantLinear(base)
            done.append(f"{path}.base_layer")
    if not done:
        raise ConfigError(
            f"finetune.base_quant={base_quant} quantises the base linears under LoRA adapters, "
            "and this model has none. Fix: --finetune.lora_rank=16 (QLoRA), or base_quant=none."
        )
    return done


def quant_layers(model: nn.Module) -> list[tuple[str, QuantLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def quantised_bytes(layers: list[QuantLinear]) -> int:
    """Bytes of the quantised weights and their statistics (what replaces the weights)."""
    return sum(
        t.numel() * t.element_size()
        for m in layers
        for key in STATE_KEYS
        if (t := getattr(m, key)) is not None
    )


def layer_bytes(out_features: int, in_features: int) -> int:
    """Bytes bitsandbytes keeps for one NF4 weight with double quantisation: 4 bits per weight,
    an 8-bit absmax per 64-weight block, the 16-entry NF4 map (fp32), an fp32 absmax per 256
    blocks and the 256-entry map of the absmax quantisation (fp32)."""
    n = out_features * in_features
    blocks = -(-n // NF4_BLOCK)
    return -(-n // 2) + blocks + 16 * 4 + 4 * -(-blocks // 256) + 256 * 4


def materialise_quantised(model: nn.Module, source, seed: int, device: torch.device) -> None:
    """Quantise every QuantLinear's weight, one layer at a time on `device`, from the value an
    unquantised run gives it: the checkpoint's tensor (`source`, models/hf_weights) or the
    (seed, name) init; identical on every rank."""
    from shardwise.models.init import canonical_name, find_spec, initial_value

    spec = find_spec(model)
    for path, layer in quant_layers(model):
        name = canonical_name(f"{path}.weight", spec)
        if source is not None and source.has(name):
            value = source.full(name, layer.shape)
        else:
            with torch.device("meta"):  # the init rule reads the module's kind: a Linear
                like = nn.Linear(layer.in_features, layer.out_features, bias=False)
            value = initial_value(like, "weight", name, layer.shape, seed, spec)
        layer.quantise_weight(value.to(device))
    if source is not None:
        source.close()
