"""The MoE decoder (models/moe.py): our Llama-style decoder with routed experts in its MLPs.

Data parallelism and ZeRO-1/2/3 (the stacked expert weights shard like any other), expert
parallelism (parallel.ep: the experts split over ranks, parallel/expert.py), pipeline
parallelism (cut as the decoder's), tensor parallelism with sequence parallelism (the experts
whole on every tp rank, each routing its own sequence shard), activation recomputation.
Context parallelism is refused. `export --format hf` writes transformers' Qwen2-MoE (the softmax
router: models/hf/qwen2_moe.py) or GLM-4-MoE (the sigmoid router: models/hf/glm4_moe.py) where
it computes the same."""

from __future__ import annotations

from shardwise.models.families.base import Family
from shardwise.models.hf import glm4_moe, qwen2_moe
from shardwise.models.moe import MoEDecoder
from shardwise.models.presets import ModelSpec


def _hf_class(spec: ModelSpec):
    """The module of the transformers class the export writes: GLM-4-MoE routes by sigmoid,
    Qwen2-MoE by softmax (each refuses what else it does not compute)."""
    return glm4_moe if spec.router == "sigmoid" else qwen2_moe


def hf_config(spec: ModelSpec, dtype: str) -> dict:
    """config.json of the export's transformers class."""
    return _hf_class(spec).config(spec, dtype)


def hf_extra(spec: ModelSpec, buffers: dict, dtype: str) -> dict:
    """The export's tensors that no parameter holds (0-wide shared experts, biases)."""
    return _hf_class(spec).extra(spec, buffers, dtype)


def hf_check(spec: ModelSpec, buffers: dict) -> list[str]:
    """Refusals of the export's class before any file is written; its notes."""
    return _hf_class(spec).check(spec, buffers)


MOE = Family(
    name="moe",
    kind="an MoE decoder",
    archs=("moe",),
    build=MoEDecoder,
    # the formulas price dense blocks: activations are measured on a fake model, and model
    # states counted from the real one's units (exact)
    formula=False,
    # attention and dense MLPs split as the decoder's; the MoE layers stay whole and, with
    # parallel.sp (required: training/checks_layout.py), route each tp rank's sequence shard
    tensor_parallel="plan",
    sequence_parallel=True,
    pipeline="blocks",  # cut as the decoder's; each stage tallies its own MoE layers
    expert_parallel=True,
    chunked_loss=True,  # the decoder's LMHead
    # softmax routing without shared experts or a moved bias: transformers' Qwen2-MoE; the
    # sigmoid router (with shared experts, its bias): GLM-4-MoE
    hf_config=hf_config,
    hf_extra=hf_extra,
    hf_check=hf_check,
)
