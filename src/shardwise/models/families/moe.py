"""The MoE decoder (models/moe.py): our Llama-style decoder with routed experts in its MLPs.

Data parallelism and ZeRO-1/2/3 (the stacked expert weights shard like any other), expert
parallelism (parallel.ep: the experts split over ranks, parallel/expert.py), pipeline
parallelism (cut as the decoder's), tensor parallelism with sequence parallelism (the experts
whole on every tp rank, each routing its own sequence shard), activation recomputation.
Context parallelism is refused. `export --format hf` writes transformers' Qwen2-MoE where it
computes the same (models/hf/qwen2_moe.py)."""

from __future__ import annotations

from shardwise.models.families.base import Family
from shardwise.models.hf import qwen2_moe
from shardwise.models.moe import MoEDecoder

MOE = Family(
    name="moe",
    kind="an MoE decoder",
    archs=("moe",),
    build=MoEDecoder,
    # the formulas price dense blocks: activations are measured on a fake model, and model
    # states counted from the real one's units (exact)
    formula=False,
    # attention and dense MLPs split as the decoder's; the MoE layers stay whole and, with
    # parallel.sp (required: training/checks.py), route each tp rank's sequence shard
    tensor_parallel="plan",
    sequence_parallel=True,
    pipeline="blocks",  # cut as the decoder's; each stage tallies its own MoE layers
    expert_parallel=True,
    chunked_loss=True,  # the decoder's LMHead
    # softmax routing without shared experts or a moved bias: transformers' Qwen2-MoE
    hf_config=qwen2_moe.config,
    hf_extra=qwen2_moe.extra,
    hf_check=qwen2_moe.check,
)
