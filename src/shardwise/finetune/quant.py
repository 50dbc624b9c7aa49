"""A frozen low-bit base (`finetune.base_quant = nf4 | int8`): QLoRA (Dettmers et al. 2023,
"QLoRA: Efficient Finetuning of Quantized LLMs") and 8-bit weights (Dettmers et al. 2022,
"LLM.int8()"), through bitsandbytes.

The base linear of every LoRA layer becomes a `QuantLinear`, its weight stored as
* nf4: bitsandbytes' 4-bit NormalFloat with double quantisation (blocks of 64 weights, the
  absmax of each block itself quantised to 8 bits in groups of 256 around their mean);
* int8: int8 codes with an fp32 absmax per row, as bitsandbytes' `Linear8bitLt` stores its
  weight (`int8_vectorwise_quant`, no outlier columns held back);
and used through `_DequantLinear`, which dequantises before the product and again in backward
(only the input's gradient is taken: the weight is frozen), so no 16/32-bit copy of the weight
is kept between forward and backward. bitsandbytes over torchao: it runs both formats on CPU
and on CUDA alike with one call each way (torchao's NF4 tensor compiles kernels on first use),
and peft speaks its formats.

Values: each rank computes the weight exactly as an unquantised run would (the checkpoint's
tensor, or the (seed, name) init) and quantises it, so every layout trains against
bit-identical base weights. The codes and their statistics are non-persistent buffers:
checkpoints do not store them (a resumed run quantises again, to the same bits), and ZeRO units
(parameters only) never hold them, so a quantised weight is never put into a float flat buffer.

Split storage (its rules and bytes: finetune/quant_shards.py): under ZeRO-3 (over dp) and
tensor parallelism (over tp) each rank keeps 1/n of every quantised weight (n = dp·tp, dp
outer): a run of whole blocks (`Shards`: 64 weights for nf4, a row for int8), read from the
checkpoint or cut from the init by itself alone. nf4 gathers the blocks' fp32 absmax once at
load (1/16 of the weight's fp32 bytes, transiently) so every rank double-quantises them exactly
as bitsandbytes does for the whole tensor. In use, the codes and their block statistics (bytes,
never floats) are all-gathered (over tp, then dp) for one layer at a time, forward and
backward, dequantised and dropped after the product; a tensor-parallel rank multiplies by its
rows (column-parallel) or columns (row-parallel) of the dequantised weight (`take`), exactly as
the float layer's split would. Data parallelism and ZeRO-1/2 keep the whole quantised base on
every rank, pipeline stages their own layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.finetune.lora import is_lora_layer
from shardwise.finetune.quant_shards import (
    ABSMAX_BLOCK,
    NF4_BLOCK,
    Shards,
    gather_split,
    split_index,
)
from shardwise.optim import quiet_bitsandbytes

STATE_KEYS = ("weight_q", "absmax", "code", "absmax2", "code2", "offset")
KINDS = ("nf4", "int8")


def _bnb(kind: str = "nf4"):
    quiet_bitsandbytes()
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bf
    except ImportError:
        raise ConfigError(
            f"finetune.base_quant={kind} stores the frozen base with bitsandbytes, which is not "
            "installed. Fix: pip install 'shardwise[finetune]' (or bitsandbytes), or "
            "--finetune.base_quant=none."
        ) from None
    return bnb, bf


class QuantLinear(nn.Module):
    """A frozen linear layer whose weight is held in nf4 or int8 (buffers set by
    `quantise_weight`); the bias, if any, stays a (frozen) parameter."""

    splits_like_linear = True  # parallel/tensor_lora.py splits it as the Linear it replaces

    def __init__(self, linear: nn.Linear, kind: str = "nf4") -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kind = kind
        self.bias = linear.bias
        self.shards = Shards(self.out_features, self.in_features, 1, kind)
        self.comm = None  # with `split`: gathers this rank's codes with the others'
        self.split: tuple[tuple[str, int], ...] = ()  # (mesh dim, ranks), outer first
        self.take: tuple[int, int, int] | None = None  # tp: (dim 0 rows | 1 columns, lo, hi)
        self.read_elements = 0  # of the weight, read from the checkpoint by this rank
        self.peak_transient = 0  # bytes gathered and dequantised for one use, at most
        self.shape_only = False  # the planner's fake forward: a weight of the right shape
        self.input_needs_grad = True  # as the last forward saw it: False, no backward use
        for key in STATE_KEYS:
            self.register_buffer(key, None, persistent=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @torch.no_grad()
    def quantise_weight(self, part: torch.Tensor, comm=None, split=()) -> None:
        """Store this rank's `part` (elements `Shards.span(split_index)` of the flattened
        [out, in] weight split over `split`; all of it when that is empty) as bitsandbytes
        stores the whole weight, bit for bit: nf4 `quantize_4bit(weight,
        compress_statistics=True)`, int8 `int8_vectorwise_quant(weight)`."""
        _, bf = _bnb(self.kind)
        self.split = tuple(split)
        n = math.prod(size for _, size in self.split)
        self.shards = Shards(self.out_features, self.in_features, n, self.kind)
        self.comm = comm if self.split else None
        s, part = self.shards, part.float().reshape(-1)
        codes = torch.zeros(s.code_bytes, dtype=torch.uint8, device=part.device)
        if self.kind == "int8":  # rows are independent: nothing to share
            stats = torch.zeros(s.chunk, dtype=torch.float32, device=part.device)
            if part.numel():
                q, row_absmax, _ = bf.int8_vectorwise_quant(part.view(-1, self.in_features))
                codes[: q.numel()] = q.flatten().view(torch.uint8)
                stats[: row_absmax.numel()] = row_absmax
            self.weight_q, self.absmax = codes, stats
            return
        absmax = torch.zeros(s.chunk, dtype=torch.float32, device=part.device)
        if part.numel():  # blocks are independent: a run of whole blocks quantises alike
            q, state = bf.quantize_4bit(part, blocksize=NF4_BLOCK, quant_type="nf4")
            codes[: q.numel()] = q.flatten()
            absmax[: state.absmax.numel()] = state.absmax
        self.code = bf.get_4bit_type("nf4", device=part.device)
        if self.comm is not None:  # every block's absmax, for the mean and 256-groups
            whole = gather_split(self.comm, absmax, self.split)[-1][: s.blocks]
        else:
            whole = absmax[: s.blocks]
        self.offset = whole.mean()
        qabsmax, state2 = bf.quantize_blockwise(whole - self.offset, blocksize=ABSMAX_BLOCK)
        rank = split_index(self.comm, self.split) if self.comm is not None else 0
        own = torch.zeros(s.chunk, dtype=torch.uint8, device=part.device)
        mine = qabsmax[rank * s.chunk : (rank + 1) * s.chunk]
        own[: mine.numel()] = mine
        self.weight_q, self.absmax = codes, own
        self.absmax2, self.code2 = state2.absmax, state2.code

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(codes, block statistics) of the whole weight, and the bytes the gather held."""
        s, codes, stats = self.shards, self.weight_q, self.absmax
        if self.comm is None:
            return codes, stats, 0
        mine = torch.cat([codes, stats.view(torch.uint8)])  # one uint8 all-gather per dim
        made = gather_split(self.comm, mine, self.split)
        rows = made[-1].view(s.n, -1)
        codes = rows[:, : s.code_bytes].flatten()
        stats = rows[:, s.code_bytes :].flatten().view(stats.dtype)[: s.blocks]
        # the gathers, the two cuts of the last, this rank's part
        held = sum(t.numel() for t in made) + made[-1].numel() + mine.numel()
        return codes, stats, held

    def weight_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole dequantised [out, in] weight in `dtype` (gathered where it is split)."""
        _, bf = _bnb(self.kind)
        if self.shape_only:
            return torch.empty(self.shape, dtype=dtype)
        if self.weight_q is None:
            raise RuntimeError("QuantLinear used before its weight was quantised")
        codes, stats, gathered = self._gather()
        if self.kind == "int8":
            q = codes[: self.shards.numel].view(torch.int8).view(self.shape)
            weight = bf.int8_vectorwise_dequant(q, stats).to(dtype)
        else:
            state2 = bf.QuantState(
                absmax=self.absmax2, code=self.code2, blocksize=ABSMAX_BLOCK, dtype=torch.float32
            )
            state = bf.QuantState(
                absmax=stats,
                shape=torch.Size(self.shape),
                code=self.code,
                blocksize=NF4_BLOCK,
                quant_type="nf4",
                dtype=dtype,
                offset=self.offset,
                state2=state2,
            )
            weight = bf.dequantize_4bit(codes[: -(-self.shards.numel // 2)].view(-1, 1), state)
        used = gathered + weight.numel() * weight.element_size()
        self.peak_transient = max(self.peak_transient, used)
        return weight

    def local_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight this rank multiplies by: all of it, or its tensor-parallel rows or
        columns (`take`)."""
        weight = self.weight_for(dtype)
        if self.take is None:
            return weight
        dim, lo, hi = self.take
        return weight.narrow(dim, lo, hi - lo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x·Wᵀ without the bias (a row-parallel split adds it after the reduction)."""
        self.input_needs_grad = x.requires_grad
        return _DequantLinear.apply(x, self)

    def dequantised(self) -> torch.Tensor:
        return self.weight_for(torch.float32)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class _DequantLinear(torch.autograd.Function):
    """x·Wᵀ with W dequantised for the product only: backward dequantises (and, under ZeRO-3,
    gathers) again instead of keeping W; the frozen weight gets no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.local_weight(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.layer.local_weight(grad.dtype), None


def quantise_base(model: nn.Module, base_quant: str, targets: str = "") -> list[str]:
    """Replace the base layer of every LoRA layer by a QuantLinear (on meta: shapes only);
    returns their paths (`...wq.base_layer`). `targets`: finetune.lora_targets, for messages."""
    if base_quant == "none":
        return []
    if base_quant not in KINDS:
        raise ConfigError(
            f"finetune.base_quant={base_quant} is not a format shardwise stores. Fix: "
            "--finetune.base_quant=nf4 (or int8, none)."
        )
    _bnb(base_quant)
    done = []
    for path, module in list(model.named_modules()):
        base = getattr(module, "base_layer", None)
        if is_lora_layer(module) and isinstance(base, nn.Linear):
            module.base_layer = QuantLinear(base, base_quant)
            done.append(f"{path}.base_layer")
    if not done:
        raise ConfigError(_nothing_to_quantise(model, base_quant, targets))
    return done


def _nothing_to_quantise(model: nn.Module, base_quant: str, targets: str) -> str:
    """Why base_quant found no adapted linear layer, and the fix that fits the model."""
    from shardwise.models.expert_lora import adapted_weights

    if adapted_weights(model):  # adapters on stacked experts only (models/expert_lora.py)
        return (
            f"finetune.base_quant={base_quant} quantises the frozen base of adapted linear "
            f"layers, and finetune.lora_targets='{targets}' adapts stacked expert weights "
            "only: the experts stay in the compute dtype, so there is nothing to quantise. "
            "Fix: add attention or MLP linears to finetune.lora_targets (e.g. "
            f"--finetune.lora_targets={targets},wq,wv), or --finetune.base_quant=none."
        )
    return (
        f"finetune.base_quant={base_quant} quantises the base linears under LoRA adapters, "
        "and this model has none. Fix: --finetune.lora_rank=16 (QLoRA), or base_quant=none."
    )


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


def materialise_quantised(
    model: nn.Module, source, seed: int, device: torch.device, comm=None, split=()
) -> None:
    """Quantise every QuantLinear's weight, one layer at a time on `device`, from the value an
    unquantised run gives it: the checkpoint's tensor (`source`, models/hf/weights) or the
    (seed, name) init. `split` (`split_dims`): each rank reads or cuts only its own blocks."""
    from shardwise.models.init import canonical_name, find_spec, initial_value

    spec = find_spec(model)
    rank = split_index(comm, split) if split else 0
    shards = math.prod(size for _, size in split)
    for path, layer in quant_layers(model):
        name = canonical_name(f"{path}.weight", spec)
        start, stop = Shards(*layer.shape, shards, layer.kind).span(rank)
        if source is not None and source.has(name):
            before = source.elements_read
            part = source.span(name, layer.shape, start, stop) if stop > start else None
            layer.read_elements = source.elements_read - before
        else:
            with torch.device("meta"):  # the init rule reads the module's kind: a Linear
                like = nn.Linear(layer.in_features, layer.out_features, bias=False)
            value = initial_value(like, "weight", name, layer.shape, seed, spec)
            part = value.flatten()[start:stop]
        if part is None:
            part = torch.empty(0)
        layer.quantise_weight(part.to(device), comm, split)
    if source is not None:
        source.close()
