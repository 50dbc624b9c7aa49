"""transformers' Qwen2-MoE (`Qwen2MoeForCausalLM`) as the export of our MoE decoder
(models/moe.py), for the settings where it computes what ours computes: the parameter map,
the config.json an export writes, the tensors of its own that it needs, and the refusals.
(The other direction, a Qwen2-MoE checkpoint trained as transformers' class, is
`model.name=hf`: models/hf/auto.py.)

Why this class (the forwards of transformers 5.24's MoE classes, read side by side):
- routing: ours takes the softmax over all experts in fp32, the top k, and weights the chosen by
  their probabilities, not renormalised. Qwen2-MoE with `norm_topk_prob=false` does exactly that;
  Mixtral always renormalises over the chosen; Qwen3-MoE and OLMoE route alike but normalise q
  and k with RMSNorms that our attention does not have.
- dense blocks: Qwen2-MoE's block i is sparse when (i + 1) % `decoder_sparse_step` == 0, our
  `moe_every` rule (models/moe.py `MoEDecoder`); its dense MLP is SwiGLU as ours.
- attention: `qkv_bias=false` is our bias-free Llama attention, RoPE in the same half-split
  pairing, `head_dim` from the config.
- shared experts: Qwen2-MoE multiplies its shared expert by sigmoid(g·x), and no weight g makes
  that 1 for every x; ours are not gated. So `n_shared_experts` > 0 is refused; without them the
  class's shared expert is written 0 wide, its output exactly zero.
- the sigmoid router (DeepSeek-V3's, normalised over the chosen) exports as GLM-4-MoE, with
  ungated shared experts and the bias as its `e_score_correction_bias` (models/hf/glm4_moe.py).
- the balancing bias (`expert_bias`, DeepSeek-V3 eq. 16) moves which experts are chosen, and
  Qwen2-MoE has no such term: a nonzero bias is refused with the layer named. It stays zero
  when the run trained with train.moe_bias_balance=0. No class of transformers 5.24 holds it
  with our blocks: the classes with a correction bias route by sigmoid (DeepSeek-V3,
  GLM-4-MoE, ...), renormalise over the chosen (Ernie 4.5's softmax), or route as ours but in
  other blocks (LongCat-Flash: two MLA attentions, with an RMSNorm on the latent, per layer).
- capacity: the class is dropless. A run with `capacity_factor` > 0 exports with a note: the
  export equals our layer wherever no expert was over its capacity in a sequence.
"""

from __future__ import annotations

import torch

from shardwise.errors import ShardwiseError
from shardwise.models.hf import llama
from shardwise.models.hf.rule import Rule
from shardwise.models.moe import moe_blocks  # (i + 1) % moe_every: decoder_sparse_step
from shardwise.models.presets import ModelSpec

_L = r"blocks\.(\d+)\."
_X = "model.layers.{0}.mlp."
RULES = (
    *llama.RULES,  # embedding, attention, norms, head, and the dense blocks' MLPs
    Rule(_L + r"mlp\.router\.weight", _X + "gate.weight"),
    Rule(_L + r"mlp\.w1", _X + "experts.gate_up_proj", part=0, parts=2, stacked=True),
    Rule(_L + r"mlp\.w3", _X + "experts.gate_up_proj", part=1, parts=2, stacked=True),
    Rule(_L + r"mlp\.w2", _X + "experts.down_proj", stacked=True),
)


def refusal(spec: ModelSpec) -> str:
    """Why Qwen2-MoE cannot hold this model ('' when it can)."""
    keep = "or keep the run in shardwise's own format (export --format dcp)"
    if spec.router != "softmax":
        return (
            f"model.router='{spec.router}' (weights normalised over the chosen experts) does "
            "not export: the transformers class this decoder exports as, Qwen2-MoE, routes by "
            f"softmax. Fix: train with --model.router=softmax, {keep}."
        )
    if spec.n_shared_experts:
        return (
            f"model.n_shared_experts={spec.n_shared_experts}: our shared experts are always on, "
            "and transformers' Qwen2-MoE (the softmax router's class) multiplies its shared "
            "expert by a sigmoid gate, which no weight holds at 1. Fix: train with "
            "--model.n_shared_experts=0, or with --model.router=sigmoid (exports as GLM-4-MoE, "
            f"ungated shared experts), {keep}."
        )
    return ""


def check(spec: ModelSpec, buffers: dict[str, torch.Tensor]) -> list[str]:
    """Refuse what the export would compute differently (the run's buffers by name: the
    balancing biases); the notes to print about what it computes."""
    why = refusal(spec)
    for name, value in buffers.items():
        if not why and name.endswith(".expert_bias") and bool(value.ne(0).any()):
            why = (
                f"{name} is not zero (largest {value.abs().max().item():.3g}; train."
                "moe_bias_balance moved it): it changes which experts ours chooses, and "
                "transformers' Qwen2-MoE (the softmax router's class) has no such bias, so its "
                "top k would differ. Fix: train with --train.moe_bias_balance=0, or with "
                "--model.router=sigmoid (exports as GLM-4-MoE, which holds the bias), or keep "
                "the run in shardwise's own format (export --format dcp)."
            )
    if why:
        raise ShardwiseError(why)
    if spec.capacity_factor > 0:
        return [
            f"model.capacity_factor={spec.capacity_factor}: the exported Qwen2-MoE is dropless "
            "(every token reaches its top-k experts); it equals the trained model wherever no "
            "expert was over its capacity in a sequence"
        ]
    return []


def extra(spec: ModelSpec, buffers: dict, dtype: str) -> dict[str, torch.Tensor]:
    """Tensors of the class that no parameter of ours holds, in `dtype`: each MoE block's shared
    expert, 0 wide (its output is exactly zero), and the gate of that shared expert (`buffers`:
    unused, the biases are zero or refused)."""
    out = {}
    for i in moe_blocks(spec):
        x = _X.format(i)
        out[x + "shared_expert.gate_proj.weight"] = torch.zeros(0, spec.dim)
        out[x + "shared_expert.up_proj.weight"] = torch.zeros(0, spec.dim)
        out[x + "shared_expert.down_proj.weight"] = torch.zeros(spec.dim, 0)
        out[x + "shared_expert_gate.weight"] = torch.zeros(1, spec.dim)
    return {k: v.to(getattr(torch, dtype)) for k, v in out.items()}


def config(spec: ModelSpec, dtype: str) -> dict:
    """config.json of our MoE decoder as transformers' Qwen2-MoE (refused where it differs)."""
    why = refusal(spec)
    if why:
        raise ShardwiseError(why)
    out = llama.config(spec, dtype)
    out.update(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        moe_intermediate_size=spec.ffn_dim,  # each routed expert
        shared_expert_intermediate_size=0,
        num_experts=spec.n_experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=False,  # our softmax weights are the chosen experts' probabilities
        decoder_sparse_step=spec.moe_every,
        mlp_only_layers=[],
        qkv_bias=False,
        use_sliding_window=False,
        output_router_logits=False,
    )
    for key in ("attention_bias", "mlp_bias"):  # Llama's names; Qwen2-MoE's is qkv_bias
        out.pop(key)
    return out
