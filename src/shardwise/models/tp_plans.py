"""Tensor-parallel plans as data: module path pattern -> how the module is split.

A pattern matches a module path segment by segment (``*`` is one segment). Kinds:

* ``column``  — output features split (Megatron's column-parallel linear);
* ``column:kv`` — a key/value projection: split by kv heads when tp divides their number,
  else each rank keeps (replicated) the one kv head its query heads read (GQA, t > kv);
* ``column:qkv`` — a fused q|k|v projection (GPT-2's ``c_attn``): each third split alike;
* ``row``     — input features split, partial outputs summed (row-parallel linear);
* ``vocab``   — the vocabulary split: an embedding (masked lookup + sum) or the output head
  (logits stay split; the loss is vocabulary-parallel);
* ``positions`` — a learned position table: with sequence parallelism each rank looks up
  its own chunk of positions;
* ``partial`` — kept whole on every rank, which uses it on its own heads only (Qwen3's
  per-head q/k norms): its gradients are summed over tp.

Everything else is replicated. ``divide`` names integer attributes of foreign attention
modules that count heads or widths and so shrink by t (GPT-2's split size).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.hf.experts import computes_experts


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a Linear whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D"


def out_dim(module: nn.Module) -> int:
    """The weight dimension of a linear layer's outputs (0 for torch's Linear)."""
    return 1 if is_conv1d(module) else 0


@dataclass(frozen=True)
class TPPlan:
    rules: dict[str, str]
    divide: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sequence_parallel: bool = True  # whether the model's forward allows sequence sharding


# The reference decoder (Llama-style) and its GPT-2 variant share module names.
DECODER = TPPlan(
    {
        "embed": "vocab",
        "pos_embed": "positions",
        "blocks.*.attn.wq": "column",
        "blocks.*.attn.wk": "column:kv",
        "blocks.*.attn.wv": "column:kv",
        "blocks.*.attn.wo": "row",
        "blocks.*.mlp.w1": "column",
        "blocks.*.mlp.w3": "column",
        "blocks.*.mlp.w2": "row",
        "head": "vocab",
    }
)

# Hugging Face GPT2LMHeadModel publishes no TP plan; its fused c_attn needs the qkv rule.
# Its forward builds positions and masks from the local sequence length, so no SP.
HF_GPT2 = TPPlan(
    {
        "transformer.wte": "vocab",
        "transformer.h.*.attn.c_attn": "column:qkv",
        "transformer.h.*.attn.c_proj": "row",
        "transformer.h.*.mlp.c_fc": "column",
        "transformer.h.*.mlp.c_proj": "row",
        "lm_head": "vocab",
    },
    divide={"transformer.h.*.attn": ("split_size", "num_heads", "embed_dim")},
    sequence_parallel=False,
)

# Hugging Face's names for the plan entries (`model._tp_plan`, from the config's
# base_model_tp_plan) -> ours. Their colwise_gather_output head gathers full logits; ours
# keeps them split for the vocabulary-parallel loss.
_HF_KINDS = {
    "colwise": "column",
    "rowwise": "row",
    "colwise_gather_output": "vocab",
    "embedding_rowwise": "vocab",
    "replicated_with_grad_allreduce": "partial",
}
# the classes whose `replicated_with_grad_allreduce` entries (the per-head q/k norms) were
# checked against one process (tests/test_hf_moe_parallel.py); another class may keep other
# weights under that kind whose partial gradients the engine would not sum (Apertus's
# activation parameters act on split features): its plan stays refused
_PARTIAL_TYPES = ("qwen3", "qwen3_moe")


def hf_plan(model: nn.Module, published: dict[str, str] | None = None) -> TPPlan:
    """The plan a Hugging Face model publishes (fully qualified in `model._tp_plan`; or the
    entries `published` of it), with k/v projections marked as such (the published plan splits
    them like any column)."""
    if published is None:
        published = getattr(model, "_tp_plan", None) or {}
    if not published:
        return HF_GPT2
    rules: dict[str, str] = {}
    for pattern, kind in published.items():
        if kind not in _HF_KINDS:
            raise ValueError(f"{type(model).__name__}: unsupported TP plan entry {kind!r}")
        ours = _HF_KINDS[kind]
        if ours == "column" and pattern.rsplit(".", 1)[-1] in ("k_proj", "v_proj"):
            ours = "column:kv"
        rules[pattern] = ours
    # sequence parallelism: parallel/tensor.py hands the forward the whole sequence's positions;
    # the families' sp_model_types name the classes checked (training/checks_layout.py)
    return TPPlan(rules, sequence_parallel=True)


def checkpoint_plan(model: nn.Module) -> TPPlan:
    """model.name=hf: the plan the model's class publishes (GPT-2's is ours), or one message.
    A gathered-output column split is the output head's kind only: on a fused projection
    inside a block (Phi-3's qkv_proj) it would need a gather the engine does not do."""
    published = getattr(model, "_tp_plan", None) or {}
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    if not published and model_type == "gpt2":
        return HF_GPT2
    moe = computes_experts(model)
    if moe:  # the experts stay whole on every tp rank (Megatron-Core's expert tp size 1)
        published = {p: k for p, k in published.items() if "experts" not in p.split(".")}
    inner = [p for p, kind in published.items() if kind == "colwise_gather_output" and "." in p]
    known = {k: v for k, v in _HF_KINDS.items() if v != "partial" or model_type in _PARTIAL_TYPES}
    unknown = sorted({kind for kind in published.values() if kind not in known})
    why = ""
    if not published:
        why = "publishes no tensor-parallel plan (base_model_tp_plan)"
    elif inner or unknown:
        why = f"publishes a plan with entries the engine cannot apply ({inner or unknown})"
    elif getattr(model.config, "tie_word_embeddings", False) and "embedding_rowwise" not in set(
        published.values()
    ):  # a split head tied to a whole embedding: one tensor, two layouts
        why = "ties its output head to the input embedding, which its plan does not split"
    why = why or _foreign_layers(model, published)
    if why:
        raise ConfigError(f"{type(model).__name__} {why}. Fix: --parallel.tp=1 (DP and ZeRO).")
    return hf_plan(model, published)


def _foreign_layers(model: nn.Module, published: dict[str, str]) -> str:
    """The split layers must be torch's own Linear / Embedding: a subclass may do more in its
    forward (Gemma's embedding scales its output) than the split forward that replaces it."""
    import fnmatch

    for name, module in model.named_modules():
        for pattern, kind in published.items():
            if name.count(".") != pattern.count(".") or not fnmatch.fnmatchcase(name, pattern):
                continue
            if _HF_KINDS.get(kind) == "partial":  # kept whole: its own forward runs
                continue
            want = nn.Embedding if kind == "embedding_rowwise" else nn.Linear
            if hasattr(module, "lora_A"):  # a peft LoRA layer: its base is what is split
                module = module.base_layer
            if type(module) is not want and not getattr(module, "splits_like_linear", False):
                return (
                    f"splits '{name}', a {type(module).__name__} (not torch's {want.__name__}, "
                    "whose forward the split replaces)"
                )
    return ""


def plan_for(model: nn.Module, arch: str) -> TPPlan:
    """The plan of a built model of `arch`."""
    if arch == "hf":
        return checkpoint_plan(model)
    if arch in ("decoder", "gpt2", "moe"):  # an MoE layer matches no rule: whole experts
        return DECODER
    if arch.startswith("hf-"):
        return hf_plan(model)
    raise ValueError(f"no tensor-parallel plan for arch {arch!r}")
