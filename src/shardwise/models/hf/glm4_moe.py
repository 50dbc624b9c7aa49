"""transformers' GLM-4-MoE (`Glm4MoeForCausalLM`) as the export of our MoE decoder with the
sigmoid router (models/moe.py), for the settings where it computes what ours computes: the
parameter map (Qwen2-MoE's, models/hf/qwen2_moe.py, plus the shared experts), the config.json
an export writes, the tensors of its own it needs (the balancing biases) and the refusals.
The softmax router exports as Qwen2-MoE (qwen2_moe.py); the family picks (families/moe.py).

Why this class (transformers 5.24's glm4_moe, read against ours):
- routing (`Glm4MoeTopkRouter`): the router in fp32, sigmoid scores, the top k of scores plus
  `e_score_correction_bias`, the chosen weighted by their unbiased scores normalised over the
  chosen (`norm_topk_prob`; it adds 1e-20 to the sum, nothing next to a sum of sigmoids in
  fp32) times `routed_scaling_factor` (1.0 here). That is DeepSeek-V3 eq. 13/16 as ours, with
  our `expert_bias` as the correction bias. With `n_group=1` and `topk_group=1` its group
  limit keeps the one group, every expert.
- shared experts: one SwiGLU `moe_intermediate_size · n_shared_experts` wide, added ungated:
  ours (n_shared_experts always-on experts = one MLP that many times wider). Without them it is
  written 0 wide, its output exactly zero.
- dense blocks: its first `first_k_dense_replace` blocks are dense SwiGLU
  (`intermediate_size`), all later ones MoE. Ours are MoE at (i + 1) % moe_every == 0: the same
  set only when the MoE blocks are the last ones (moe_every=1, or moe_every = n_layers); other
  layouts are refused.
- attention: Llama's (bias-free with `attention_bias=false`, `o_proj` never has one), q/k
  RMSNorms off (`use_qk_norm=false`), `head_dim` from the config, RoPE in the half-split
  pairing (`rotate_half`) as ours; its rotary covers `partial_rotary_factor` of each head
  (its default 0.5), written 1.0: all of it, as ours.
- the class is dropless: a run with `capacity_factor` > 0 exports with a note, as Qwen2-MoE.
shardwise's intake (`model.name=hf`) reads the export back as this class, its correction bias
(a persistent buffer) from the safetensors too (models/hf/buffers.py).
"""

from __future__ import annotations

import torch

from shardwise.errors import ShardwiseError
from shardwise.models.hf import llama, qwen2_moe
from shardwise.models.hf.rule import Rule
from shardwise.models.moe import moe_blocks
from shardwise.models.presets import ModelSpec

_L = r"blocks\.(\d+)\.mlp\.shared\."
_X = "model.layers.{0}.mlp."
RULES = (
    *qwen2_moe.RULES,  # embedding, attention, norms, head, dense MLPs, routers, experts
    Rule(_L + r"w1\.weight", _X + "shared_experts.gate_proj.weight"),
    Rule(_L + r"w3\.weight", _X + "shared_experts.up_proj.weight"),
    Rule(_L + r"w2\.weight", _X + "shared_experts.down_proj.weight"),
)
_KEEP = "or keep the run in shardwise's own format (export --format dcp)"


def first_dense(spec: ModelSpec) -> int | None:
    """GLM-4-MoE's `first_k_dense_replace` for our layout, None when no k gives it (our MoE
    blocks are not the last ones)."""
    moe = moe_blocks(spec)
    k = spec.n_layers - len(moe)
    return k if moe == list(range(k, spec.n_layers)) else None


def refusal(spec: ModelSpec) -> str:
    """Why GLM-4-MoE cannot hold this model ('' when it can)."""
    if spec.router != "sigmoid":
        return (
            f"model.router='{spec.router}' with model.n_shared_experts={spec.n_shared_experts} "
            "does not export: transformers' GLM-4-MoE (ungated shared experts) routes by "
            "sigmoid, and Qwen2-MoE (softmax) gates its shared expert. Fix: train with "
            f"--model.router=sigmoid or --model.n_shared_experts=0, {_KEEP}."
        )
    if first_dense(spec) is None:
        moe = moe_blocks(spec)
        return (
            f"model.moe_every={spec.moe_every} with model.n_layers={spec.n_layers} makes blocks "
            f"{moe} MoE; transformers' GLM-4-MoE (the sigmoid router's class) has its dense "
            "blocks first and the MoE blocks after them. Fix: train with --model.moe_every=1 "
            f"(or moe_every = n_layers), {_KEEP}."
        )
    return ""


def bias_name(block: int) -> str:
    """Our balancing bias of MoE block `block`, as a checkpoint names the buffer."""
    return f"blocks.{block}.mlp.expert_bias"


def check(spec: ModelSpec, buffers: dict[str, torch.Tensor]) -> list[str]:
    """Refuse what the export would compute differently, and a checkpoint without the biases
    (`buffers`: the run's buffers by name); the notes to print about what it computes."""
    why = refusal(spec)
    missing = [bias_name(i) for i in moe_blocks(spec) if bias_name(i) not in buffers]
    if not why and missing:
        why = (
            f"the checkpoint holds no {missing[0]}: GLM-4-MoE's e_score_correction_bias would "
            "be a guess. Fix: export a checkpoint that shardwise's training wrote (it saves "
            "the biases with the model)."
        )
    if why:
        raise ShardwiseError(why)
    if spec.capacity_factor > 0:
        return [
            f"model.capacity_factor={spec.capacity_factor}: the exported GLM-4-MoE is dropless "
            "(every token reaches its top-k experts); it equals the trained model wherever no "
            "expert was over its capacity in a sequence"
        ]
    return []


def extra(spec: ModelSpec, buffers: dict[str, torch.Tensor], dtype: str) -> dict:
    """Tensors of the class that no parameter of ours holds: each MoE block's balancing bias as
    its router's `e_score_correction_bias`, in fp32 whatever `dtype` (transformers keeps it in
    fp32, and ours adds it to fp32 scores: a rounded bias could change the top k), and without
    shared experts the class's one, 0 wide."""
    check(spec, buffers)
    out = {}
    for i in moe_blocks(spec):
        x = _X.format(i)
        out[x + "gate.e_score_correction_bias"] = buffers[bias_name(i)].float()
        if not spec.n_shared_experts:
            out[x + "shared_experts.gate_proj.weight"] = torch.zeros(0, spec.dim)
            out[x + "shared_experts.up_proj.weight"] = torch.zeros(0, spec.dim)
            out[x + "shared_experts.down_proj.weight"] = torch.zeros(spec.dim, 0)
    dt = getattr(torch, dtype)
    return {k: v if k.endswith("_bias") else v.to(dt) for k, v in out.items()}


def config(spec: ModelSpec, dtype: str) -> dict:
    """config.json of our MoE decoder as transformers' GLM-4-MoE (refused where it differs)."""
    why = refusal(spec)
    if why:
        raise ShardwiseError(why)
    out = llama.config(spec, dtype)
    rope = {**out["rope_parameters"], "partial_rotary_factor": 1.0}  # its default is 0.5
    out.update(
        architectures=["Glm4MoeForCausalLM"],
        model_type="glm4_moe",
        moe_intermediate_size=spec.ffn_dim,  # each routed expert; shared: n_shared_experts ×
        n_routed_experts=spec.n_experts,
        n_shared_experts=spec.n_shared_experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=True,  # DeepSeek-V3 eq. 13: sigmoid gates over the chosen
        routed_scaling_factor=1.0,
        n_group=1,  # one group: the group limit keeps every expert
        topk_group=1,
        first_k_dense_replace=first_dense(spec),
        use_qk_norm=False,
        partial_rotary_factor=1.0,
        rope_parameters=rope,
        num_nextn_predict_layers=0,  # no multi-token prediction modules
        output_router_logits=False,
    )
    out.pop("mlp_bias")  # Llama's name; GLM-4-MoE's MLPs have no biases
    return out
