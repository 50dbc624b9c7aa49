"""FP8 training (`precision.fp8=tensorwise|rowwise`): the blocks' linear layers multiply in
FP8 through torchao's float8 training (`convert_to_float8_training`), as torchtitan does.

Each converted layer casts its input, weight and output gradient to FP8 with a scale taken
from their current absolute maximum (dynamic scaling): one scale per tensor ("tensorwise") or
one per row ("rowwise", finer and more robust to outliers, slower). Parameters, optimizer
state and everything outside the matmuls stay in the compute dtype and fp32, so ZeRO,
checkpoints and the optimizer never see an FP8 tensor. Only the modules the family names
convert (`Family.fp8_linear`): embedding, output head, norms and routers keep their precision.

On a CUDA device with FP8 tensor cores (compute capability 8.9+) the matmuls run on them. On
CPU torchao's `emulate=True` runs the same casts and scales and multiplies the FP8 values in
fp32 ("numerics mode"): the numbers of FP8 training, without its speed.

Compiled blocks (`train.compile=blocks`) compile torchao's casts bit-exactly; their bf16 inputs
round at other points (inductor's fused chains), which dynamic scaling amplifies into a second
draw of FP8's roundings: tests/test_fp8_compile.py bounds it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import torch
from torch import nn

from shardwise.config import Config
from shardwise.distributed import device as dev
from shardwise.errors import ConfigError
from shardwise.finetune.lora import is_adapter_name
from shardwise.models.families import Family
from shardwise.models.presets import ModelSpec

# torch._scaled_mm wants every GEMM dimension a multiple of 16 (torchao's own filter example);
# numerics mode keeps the same rule so CPU runs convert exactly the layers a GPU run would
FP8_ALIGN = 16


def torchao_installed() -> bool:
    """Whether torchao can be imported (the `fp8` extra), without importing it."""
    return importlib.util.find_spec("torchao") is not None


def check_fp8(cfg: Config, spec: ModelSpec, family: Family, tp: int) -> None:
    """precision.fp8: the families and layouts whose FP8 training is tested; refuse the rest."""
    recipe = cfg.precision.fp8
    if recipe == "none":
        return
    why = ""
    if not torchao_installed():
        why = (
            "torchao is not installed. Fix: pip install -c constraints.txt -e '.[fp8]' "
            "(torchao 0.18), or --precision.fp8=none"
        )
    elif family.fp8_linear is None:
        why = (
            f"model.name='{cfg.model.name}' is {family.kind}, whose FP8 training is not tested "
            "(the built-in decoders', the hf-llama presets' and Llama, Mistral, Qwen2 and Qwen3 "
            "checkpoints' is)"
        )
    elif cfg.precision.compute != "bf16":
        why = (
            f"precision.compute={cfg.precision.compute}: torchao's float8 recipes keep bf16 "
            "activations between the FP8 matmuls (fp16 would also stack its loss scale on "
            "FP8's scales). Fix: --precision.compute=bf16"
        )
    elif cfg.finetune.base_quant != "none":
        why = (
            f"finetune.base_quant={cfg.finetune.base_quant} stores the blocks' frozen linear "
            "layers in 4/8 bits, which FP8 training cannot convert. Fix: "
            "--finetune.base_quant=none (LoRA on a bf16 base converts), or --precision.fp8=none"
        )
    elif tp > 1:
        why = _tp_refusal(cfg, family, tp)
    if not why and family.fp8_model_types:  # a checkpoint's class: its model_type decides
        why = _model_type_refusal(spec, family)
    if why:
        fix = "" if "Fix:" in why else " Fix: --precision.fp8=none."
        raise ConfigError(f"precision.fp8={recipe}: {why}.{fix}")


def _tp_refusal(cfg: Config, family: Family, tp: int) -> str:
    """Why FP8 cannot run under parallel.tp=`tp` ("" when it can)."""
    if not family.fp8_tensor_parallel:
        # a tp rank scales its own slice of a weight, activation or gradient by that slice's
        # maximum: other numbers than one process's, checked for the built-in decoders only
        return (
            f"parallel.tp={tp} with model.name='{cfg.model.name}' ({family.kind}): each tp "
            "rank would scale its own slices by their own maximum, which is checked against "
            "one process for the built-in decoders only. Fix: --parallel.tp=1 (dp and ZeRO-3 "
            "shard the model with one process's numbers), or --precision.fp8=none"
        )
    if cfg.finetune.lora_rank:
        return (
            f"finetune.lora_rank={cfg.finetune.lora_rank} with parallel.tp={tp}: the split "
            "LoRA layers multiply their frozen base outside torchao's FP8 casts "
            "(parallel/tensor_lora.py). Fix: --parallel.tp=1, or --precision.fp8=none"
        )
    return ""


def _model_type_refusal(spec: ModelSpec, family: Family) -> str:
    """Why the checkpoint's layers do not convert ("" when its model_type is tested)."""
    from shardwise.models.hf.auto import read_hf_config

    kind = getattr(read_hf_config(spec.source), "model_type", "?")
    if kind in family.fp8_model_types:
        return ""
    return (
        f"model.init_from holds a '{kind}' model, and FP8 training converts the decoder "
        f"layers of {', '.join(family.fp8_model_types)} models only (their q/k/v/o and "
        "gate/up/down projections; others name or shape their layers otherwise)"
    )


def fp8_emulated(info: dev.DeviceInfo, recipe: str) -> bool:
    """Whether FP8 runs in numerics mode here (CPU: emulated matmuls); refuses a CUDA device
    without FP8 tensor cores."""
    cap = dev.capability(info)
    if cap is None:
        return True
    if cap < dev.FP8_CAPABILITY:
        need = ".".join(map(str, dev.FP8_CAPABILITY))
        raise ConfigError(
            f"precision.fp8={recipe} needs FP8 tensor cores (CUDA compute capability {need}+: "
            f"H100, H200, L40S, RTX 4090 and later), but {info.name} has "
            f"{cap[0]}.{cap[1]}. Fix: --precision.fp8=none (bf16 is this card's fastest)."
        )
    return False


def fp8_config(recipe: str, emulate: bool):
    """torchao's recipe `recipe` ("tensorwise" | "rowwise"), emulated or not."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def apply_fp8(model: nn.Module, family: Family, recipe: str, info: dev.DeviceInfo) -> int:
    """Swap the family's block linear layers of `model` for torchao's Float8Linear (same
    parameters, same names); returns how many were converted ("none": 0)."""
    if recipe == "none":
        return 0
    emulate = fp8_emulated(info, recipe)
    from torchao.float8 import convert_to_float8_training

    wanted = family.fp8_linear
    assert wanted is not None  # check_fp8 refused the family before launch
    converted: list[str] = []

    def keep(module: nn.Module, name: str) -> bool:
        ok = (
            type(module) is nn.Linear
            and wanted(name)
            and not is_adapter_name(name)  # LoRA's small adapters keep the compute dtype
            and module.in_features % FP8_ALIGN == 0
            and module.out_features % FP8_ALIGN == 0
        )
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, module_filter_fn=keep, config=fp8_config(recipe, emulate))
    return len(converted)


def is_fp8(module: nn.Module) -> bool:
    """Whether `module` is a converted FP8 linear layer (torchao never imported: none is)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


def fp8_matmul(
    module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` through `module`'s FP8 casts: what Float8Linear.forward does,
    for callers (tensor parallelism's sharded forwards) that pass the weight themselves."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    y = matmul_with_hp_or_float8_args.apply(x, weight.t(), module.linear_mm_config, module.config)
    if bias is None:
        # the row-parallel exit sums this output over tp in place, which autograd forbids on a
        # view a custom Function returned: one copy of the output (under tp only)
        return y.clone()
    return y + bias.to(y.dtype)


# eager FP8's step over eager bf16's, the 1b decoder on one H200 (benchmarks/RESULTS.md, "Speed
# on one GPU": 949.6 / 370.1 and 899.3 / 370.1 ms in two runs): each cast, scale and amax its
# own kernel; compiled blocks fuse them and the same run took 0.71x AMP's step
EAGER_FP8_SLOWDOWN = "2.4-2.6x"


# compiled FP8 rowwise's step over tensorwise's, the same H200 runs (334.5 / 271.0, 334.4 / 269.2)
ROWWISE_SLOWDOWN = "1.24x"


def _compile_advice(refused: str) -> str:
    """The fix for unfused FP8 casts, or why it is not available to this job (a sentence
    without its full stop: each caller ends it)."""
    if refused:
        return f"Compiled blocks, which fuse them, are refused here: {refused.rstrip('.')}"
    return "Fix: --train.compile=blocks"


def fp8_price_note(recipe: str, compiled: bool, on_cpu: bool, refused: str = "") -> str | None:
    """What `explain` cannot price of FP8 on a GPU: the casts. It prices the blocks' GEMMs at
    the card's FP8 peak; the casts, scales and amax reductions around them are not in the step
    time, which matters most where they run unfused (eager) and for rowwise's per-row scales.
    `refused`: why this job's blocks cannot be compiled ("" when they can)."""
    if recipe == "none" or on_cpu:
        return None
    missing = []
    if not compiled:
        missing.append(
            "without train.compile=blocks each cast runs as its own kernel: an eager "
            f"tensorwise step took {EAGER_FP8_SLOWDOWN} the bf16 step's time (predicted: "
            f"faster than bf16). {_compile_advice(refused)}"
        )
    if recipe == "rowwise":
        missing.append(f"rowwise's per-row scales took {ROWWISE_SLOWDOWN} tensorwise's step")
    if not missing:
        return None
    return (
        f"shardwise: precision.fp8={recipe}: the step time prices the FP8 GEMMs at the card's "
        "FP8 peak, not the casts around them; on an H200 (the 1b decoder, "
        f"benchmarks/RESULTS.md): {'; '.join(missing)}."
    )


def fp8_summary(
    recipe: str, converted: int, emulated: bool, compiled: bool = True, refused: str = ""
) -> str:
    """One log line: the recipe, how many layers convert, whether the matmuls are real, and,
    for real FP8 without compiled blocks, that the unfused casts make the step slower, with
    the fix (or, `refused`, why compiled blocks are not available to this job)."""
    how = (
        "numerics mode: torchao emulate=True, FP8 casts and scales exact, matmuls in fp32, "
        "no speed-up"
        if emulated
        else "FP8 tensor cores"
    )
    line = f"shardwise: precision.fp8={recipe}: {converted} block linear layer(s) in FP8 ({how})"
    if emulated or compiled:
        return line
    fix = _compile_advice(refused)
    if not refused:
        fix += " (compiled, the FP8 step took 0.73x the eager bf16 one)"
    return (
        f"{line}. Without compiled blocks each FP8 cast and scale runs as its own kernel: on an "
        f"H200 such a step took {EAGER_FP8_SLOWDOWN} the bf16 step's time. {fix}."
    )
