"""Activation memory of transformers' own blocks (the hf-llama and hf-gpt2 presets): the
tensors autograd saves in LlamaDecoderLayer and GPT2Block (transformers 5, SDPA attention),
listed as plan/activations.py lists ours, after Korthikanti et al. 2022 §4 and counted as
memory.ActivationMeter counts them (one storage once, parameters excluded). A test checks
them byte for byte against the meter on the real model's fake forward.

Where they differ from our blocks (plan/activations.block_terms):
* LlamaRMSNorm keeps its fp32 input and rstd, the normalised value cast back to the compute
  dtype (the weight's multiply reads it) and the output; no fp32 weight copy.
* GPT-2's LayerNorm runs in the compute dtype: its input, mean and rstd (compute dtype too).
* The rotary tables (cos, sin: [1, 1, s, head_dim], compute dtype) are made once per forward
  by LlamaModel.rotary_emb and shared by every layer; rotating q and k saves only them.
* SDPA reads k and v at their KV heads (`enable_gqa`), saving q, k, v, the output (o_proj's
  input is a view of it) and the fp32 log-sum-exp; GPT-2's q, k and v are views of c_attn's
  one output.
* GPT-2's `gelu_new` is 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))) as element-wise ops: x,
  tanh's output, 1 + tanh, 0.5·x, and their product (c_proj's input), five [s, b, f] tensors.

Packed rows restart positions per sample (tables and GPT-2's position ids per sample) and give
SDPA a mask, which turns `enable_gqa` off (k and v saved repeated). Under tp the heads and the
MLP width split as Megatron-LM splits them (k/v: `KVTerm`). Neither preset recomputes
(selective and full are refused for them), has dropout (refused: torch's global generator) or
runs sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardwise.models import ModelSpec
from shardwise.models.families import family_of
from shardwise.plan.terms import NORMALISED, RECOMPUTED_INPUTS, WEIGHT_INPUTS, Term


@dataclass(frozen=True)
class KVTerm(Term):
    """k and v at their KV heads: tp beyond them leaves each rank the one its query heads
    read (parallel/tensor.py replicates the k/v projections when tp does not divide them)."""

    heads: int = 1

    def per_rank(self, t: int, sp: bool, selective: bool) -> float:
        return self.nbytes / min(t, self.heads)


def hf_norm_terms(spec: ModelSpec, s: int, b: int, c: int, where: str) -> list[Term]:
    """transformers' LlamaRMSNorm (fp32 inside) or GPT-2's LayerNorm (in compute dtype)."""
    sbh, sb = s * b * spec.dim, s * b
    if family_of(spec).block.layer_norm:
        out = [
            Term(f"{where} input", c * sbh, False, True),
            Term(f"{where} mean, rstd", 2 * c * sb, False, True),
        ]
    else:
        out = [
            Term(f"{where} input (fp32)", 4 * sbh, False, True),
            Term(f"{where} rstd", 4 * sb, False, True),
            # read by the weight's multiply only: gone when the weight is frozen (LoRA)
            Term(f"{where} normalised", c * sbh, False, True),
        ]
    return [*out, Term(f"{where} output", c * sbh, False, False)]


def hf_block_terms(spec: ModelSpec, s: int, b: int, c: int, packed: bool) -> tuple[Term, ...]:
    """One LlamaDecoderLayer or GPT2Block in compute dtype of `c` bytes; `packed` rows give SDPA
    an explicit mask, which turns its `enable_gqa` off: k and v are saved repeated to H heads."""
    sbf, sbq = s * b * spec.ffn_dim, s * b * spec.q_dim
    kv = spec.n_kv_heads / spec.n_heads
    block = family_of(spec).block
    out = hf_norm_terms(spec, s, b, c, "attn_norm")
    if block.fused_qkv:  # SDPA's q, k, v: views of c_attn's output
        out.append(Term("c_attn output (SDPA q, k, v)", 3 * c * sbq, True, False))
    elif packed:  # q and k rotated, k and v repeated (transformers' repeat_kv)
        out.append(Term("SDPA q, k, v (repeated)", 3 * c * sbq, True, False))
    else:  # q and k rotated, v transposed: k and v at their KV heads
        out.append(Term("SDPA q", c * sbq, True, False))
        out.append(KVTerm("SDPA k, v", 2 * c * sbq * kv, True, False, heads=spec.n_kv_heads))
    out += [
        Term("SDPA log-sum-exp", 4 * b * spec.n_heads * s, True, False),
        Term("attention output (wo input)", c * sbq, True, False),
    ]
    out += hf_norm_terms(spec, s, b, c, "mlp_norm")
    if block.gated_mlp:
        out += [
            Term("w1, w3 outputs", 2 * c * sbf, True, False),
            Term("silu(w1 x)", c * sbf, True, False),
        ]
    else:
        out.append(Term("gelu_new's x, tanh, 1 + tanh, x / 2", 4 * c * sbf, True, False))
    out.append(Term("w2 input", c * sbf, True, False))
    return tuple(out)


def hf_position_terms(spec: ModelSpec, s: int, b: int, c: int, packed: bool) -> list[Term]:
    """Made once per forward (on the stage with the embedding): LlamaModel's cos and sin
    tables, GPT-2's position ids; per sample where packed rows restart their positions."""
    rows = b if packed else 1
    if family_of(spec).block.learned_positions:
        return [Term("position ids", 8 * s * rows, False, True)]
    if not family_of(spec).block.rotary:
        return []
    tables = 2 * c * s * spec.head_dim * rows
    return [Term("RoPE tables (shared by the layers)", tables, False, False)]


def hf_lora_edges(spec: ModelSpec, s: int, b: int, c: int, edges: list[Term]) -> tuple[Term, ...]:
    """The edges of a LoRA run (`activations.lora_terms`): the frozen embedding (and position
    table) save no ids (the first block's share: `hf_first_block`)."""
    ids = ("token ids", "local token ids and mask", "position ids")  # (tp: vocab-parallel)
    return tuple(term for term in edges if term.name not in ids)


# the saved term that is each adapted linear's input (its adapter's A reads it)
_ADAPTER_INPUT = {
    "wqkv": "attn_norm output",
    "wq": "attn_norm output",
    "wk": "attn_norm output",
    "wv": "attn_norm output",
    "wo": "attention output (wo input)",
    "w1": "mlp_norm output",
    "w3": "mlp_norm output",
    "w2": "w2 input",
}
_ATTENTION_INPUTS = ("attn_norm output", "attention output (wo input)")


def weight_readers(spec: ModelSpec, name: str, selective: bool = False) -> tuple[str, ...] | None:
    """The linears whose weight gradients alone read the saved tensor `name` (terms.WEIGHT_INPUTS),
    None where something else reads it: SDPA saves its output (wo's input) for its own backward,
    but our blocks' explicit softmax (model.attn_dropout) saves none, nor does a core that
    `selective` recomputation checkpoints (its output is no saved tensor inside the region), so
    only wo's weight keeps it there (and nothing in a LoRA run that does not adapt wo)."""
    if (
        name == _ADAPTER_INPUT["wo"]
        and (spec.attn_dropout or selective)
        and not family_of(spec).block.transformers
    ):
        return ("wo",)
    return WEIGHT_INPUTS.get(name)


def hf_first_block(
    spec: ModelSpec,
    s: int,
    b: int,
    c: int,
    targets,
    packed: bool,
    dropout: bool = False,
    alone: bool = False,
) -> tuple[Term, ...]:
    """What the first block saves in `lora_terms`' count but not in a LoRA run, as negative
    terms: its input comes from the frozen embedding, so nothing before its first adapted
    linear needs a gradient, and those ops save nothing (the first norm's input and
    statistics; without a q/k/v adapter the attention too, and so on). With dropout, the
    adapters reading that first input keep their dropped input (A's weight gradient reads
    it) but no mask: models/dropout._ApplyMask saves it only for an input with a gradient;
    and SDPA, without a gradient, keeps no output for wo's adapter to share."""
    out = first_block_unsaved(spec, s, b, hf_block_terms(spec, s, b, c, packed), targets, dropout)
    if alone and not {"wq", "wk", "wqkv"} & set(targets):  # no later block (`alone`) and no
        # adapted q or k: no rotation has a gradient, the shared tables are not saved
        shared = hf_position_terms(spec, s, b, c, packed) if family_of(spec).block.rotary else []
        out += tuple(replace(x, name=f"first block {x.name}", nbytes=-x.nbytes) for x in shared)
    return out


def first_block_unsaved(
    spec: ModelSpec,
    s: int,
    b: int,
    block: tuple[Term, ...],
    targets,
    dropout: bool,
    selective: bool = False,
) -> tuple[Term, ...]:
    """The terms of the first block (`block`, as `lora_terms` counts them) that a LoRA run does
    not save, as negative terms: every one before its first adapted linear's input (nothing
    there needs a gradient) but, under `selective` recomputation, the recomputed regions'
    inputs (terms.RECOMPUTED_INPUTS: saved either way), that input's adapter masks with dropout
    (and SDPA's output when it is wo's input), and one factor of a gated MLP with one of its
    two linears adapted."""
    inputs = {_ADAPTER_INPUT[x] for x in targets if x in _ADAPTER_INPUT}
    terms = {term.name: term for term in block}  # (the MLP's, named once)
    kept = RECOMPUTED_INPUTS if selective else ()
    out = []
    for term in block:  # (a list: our attention's and residual's dropout masks share a name)
        name, read = term.name, weight_readers(spec, term.name, selective) is not None
        if name in inputs:
            if dropout:
                out += _unmasked_adapters(spec, s, b, name, targets)
                # SDPA's output, counted for wo's adapter to share (`weight_readers`)
                out += [term] if name == "attention output (wo input)" and not read else []
            break
        if not (name.endswith(NORMALISED) or read or name in kept):  # (not counted; saved)
            out.append(term)
    gate_up = {"w1", "w3"} & set(targets) if family_of(spec).block.gated_mlp else set()
    if len(gate_up) == 1 and inputs.isdisjoint(_ATTENTION_INPUTS):
        # act(gate) * up in the first block, one factor without a gradient: an adapted gate
        # alone saves its output and up's, not silu's; an adapted up alone saves silu's only
        # (a recomputed activation keeps both outputs, its inputs, and saves no silu)
        unsaved = "silu(w1 x)" if gate_up == {"w1"} else "w1, w3 outputs"
        out += [] if unsaved in kept else [terms[unsaved]]
    return tuple(replace(x, name=f"first block {x.name}", nbytes=-x.nbytes) for x in out)


def lora_unadapted_terms(terms) -> tuple[Term, ...]:
    """What a block (`terms`) before a LoRA run's first adapted one saves, where no input,
    weight or adapter has a gradient: under selective recomputation its recomputed regions'
    inputs (terms.RECOMPUTED_INPUTS), nothing otherwise."""
    inputs = [term for term in terms if term.name in RECOMPUTED_INPUTS]
    return tuple(replace(term, when="selective_only") for term in inputs)


def _unmasked_adapters(spec: ModelSpec, s: int, b: int, first: str, targets) -> list[Term]:
    """The 1-byte masks of the adapters whose input is `first` (lora_terms' "adapter input,
    mask" share), split as lora_terms splits them: the row-parallel layers' input by tp."""
    width = {"wo": spec.n_heads * spec.head_dim, "w2": spec.ffn_dim}
    return [
        Term(f"{x} adapter mask", s * b * width.get(x, spec.dim), x in ("wo", "w2"), False)
        for x in targets
        if _ADAPTER_INPUT.get(x) == first
    ]


def repeated_heads(spec: ModelSpec, tp: int) -> float:
    """k/v heads the cp kernels add on one tp rank by repeating its KV heads to its query
    heads (parallel/context_hf.py repeats by the rank's own H/tp over its KV heads): H/tp
    query heads over KV/tp KV heads, or over the one KV head a rank keeps when tp exceeds
    them (parallel/tensor.py replicates the k/v projections)."""
    return spec.n_heads / tp - spec.n_kv_heads / min(tp, spec.n_kv_heads)


def cp_repeated_kv_bytes(
    spec: ModelSpec, s: int, b: int, c: int, cp: int, tp: int, packed: bool
) -> float:
    """What LlamaDecoderLayer's attention through the cp kernels (parallel/context_hf.py) saves
    beyond its own SDPA, per layer: SDPA keeps k and v at their KV heads (`enable_gqa`), the
    kernels keep them repeated to the rank's query heads, 2·`repeated_heads`·b·(s/cp)·head_dim
    more elements in the compute dtype (as job/measured.repeated_kv_bytes adds to a fake
    forward). 0 at cp = 1, for packed rows (`hf_block_terms` has them repeated already) and
    for heads wider than 256 (no `enable_gqa`)."""
    if cp == 1 or packed or spec.n_kv_heads == spec.n_heads or spec.head_dim > 256:
        return 0.0
    return 2 * repeated_heads(spec, tp) * b * (s // cp) * spec.head_dim * c
