"""LoRA adapters on stacked expert weights (Hu et al. 2021, applied per expert), computed inside
the grouped expert products; nothing here knows about ranks.

An experts module (models/moe.py's `MoE`, or transformers' stacked experts of Mixtral, Qwen2-MoE
and OLMoE, models/hf/experts.py) holds each routed weight as one [E, ...] parameter. An adapted
weight gets a low-rank pair per expert, kept in two `ExpertAdapters` children named `lora_A` and
`lora_B`, so the parameters are `<module>.lora_A.<weight>` [E, r, in] and
`<module>.lora_B.<weight>` [E, out, r]. Expert e's product becomes
x·W_e + (alpha / r)·(x·A_eᵀ)·B_eᵀ, both factors through the same grouped matmul as the base
(`expert_matmul`), so the rows never leave their expert group and no [E, out, in] delta is
formed.

Why not peft's `target_parameters`: its ParamWrapper holds B as [out, r·E] with the expert as
the fastest index (no contiguous slice per expert, so expert parallelism could not cut it like
the experts), and it forms the whole delta weight on every forward.

Expert parallelism cuts both along dim 0 with the weight they adapt (parallel/expert.py); init
draws A per expert as peft draws a Linear's A (Kaiming-uniform, a = sqrt(5): bound
1/sqrt(in)) and B zero, from (seed, name) (models/init.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PARTS = ("lora_A", "lora_B")  # the child names: parameters `<experts>.lora_A.<weight>`


class ExpertAdapters(nn.ParameterDict):
    """One factor (A or B) of every adapted stacked weight of an experts module, by weight name."""


def add_expert_adapters(
    module: nn.Module, leaves: list[str], rank: int, alpha: float, in_out: bool
) -> None:
    """Give `module` (on meta) a trainable pair per weight in `leaves`, whose layout is
    [E, in, out] when `in_out` (ours), else [E, out, in] (transformers')."""
    a, b = ExpertAdapters(), ExpertAdapters()
    for leaf in leaves:
        w = module._parameters[leaf]
        e, d_in, d_out = w.shape if in_out else (w.shape[0], *w.shape[:0:-1])
        a[leaf] = nn.Parameter(torch.empty(e, rank, d_in, device=w.device, dtype=w.dtype))
        b[leaf] = nn.Parameter(torch.empty(e, d_out, rank, device=w.device, dtype=w.dtype))
    module.lora_A, module.lora_B = a, b
    module.lora_scale, module.expert_in_out = alpha / rank, in_out


def expert_adapters(module: nn.Module) -> list[str]:
    """The adapted weights of an experts module ([] without adapters)."""
    adapters = getattr(module, PARTS[0], None)
    return list(adapters.keys()) if isinstance(adapters, ExpertAdapters) else []


def adapter_delta(
    module: nn.Module, leaf: str, xs: torch.Tensor, counts: torch.Tensor | None, matmul
) -> torch.Tensor | None:
    """(alpha / r)·(x·A_eᵀ)·B_eᵀ of every row for weight `leaf` of `module`, rows grouped by
    expert as `matmul(xs, w [E, in, out], counts)` takes them; None when `leaf` has none."""
    if leaf not in expert_adapters(module):
        return None
    a, b = module.lora_A[leaf].to(xs.dtype), module.lora_B[leaf].to(xs.dtype)
    # torch._grouped_mm takes 16-byte strides only, and the rank is a stride of both factors
    # and of x·Aᵀ (r = 4 in bf16: 8 bytes): the rank is padded with zeros to a multiple, whose
    # terms add exact zeros
    pad = -a.shape[1] % max(1, 16 // xs.element_size())
    if pad:
        a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
    low = matmul(xs, a.transpose(-2, -1), counts)
    return matmul(low, b.transpose(-2, -1), counts) * module.lora_scale


def merged_delta(a: torch.Tensor, b: torch.Tensor, scale: float, in_out: bool) -> torch.Tensor:
    """The adapters' change to the stacked weight, in its layout: [E, in, out] when `in_out`
    (ours), else [E, out, in] (transformers'); peft's merge W + (alpha / r)·B·A per expert."""
    delta = torch.bmm(b.float(), a.float()) * scale  # [E, out, in]
    return delta.transpose(-2, -1) if in_out else delta


def adapted_weights(model: nn.Module) -> dict[str, bool]:
    """Every adapted stacked weight of `model` by parameter name -> its layout (`in_out`)."""
    return {
        f"{path}.{leaf}" if path else leaf: module.expert_in_out
        for path, module in model.named_modules()
        for leaf in expert_adapters(module)
    }
