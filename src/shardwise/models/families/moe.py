"""The MoE decoder (models/moe.py): our Llama-style decoder with routed experts in its MLPs.

Data parallelism and ZeRO-1/2/3 (the stacked expert weights shard like any other), expert
parallelism (parallel.ep: the experts split over ranks, parallel/expert.py), activation
recomputation. Tensor, pipeline and context parallelism are refused."""

from __future__ import annotations

from shardwise.models.families.base import Family
from shardwise.models.moe import MoEDecoder

MOE = Family(
    name="moe",
    kind="an MoE decoder",
    archs=("moe",),
    build=MoEDecoder,
    # the formulas price dense blocks: activations are measured on a fake model, and model
    # states counted from the real one's units (exact)
    formula=False,
    tensor_parallel="none",
    tp_refusal="parallel.tp={tp}: tensor parallelism of the MoE decoder's experts is not "
    "built yet (model.name='{name}'). Fix: --parallel.tp=1 (data parallelism and ZeRO-1/2/3 "
    "shard the experts).",
    pipeline="none",
    expert_parallel=True,
    chunked_loss=True,  # the decoder's LMHead
)
