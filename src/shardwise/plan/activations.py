"""Activation memory per transformer layer, after Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", §4), written as the list of tensors a block saves
for backward, each with how tensor/sequence parallelism and selective recomputation treat it.

`paper_gpt_terms` is the paper's GPT block (fp16, dropout masks of 1 byte, softmax materialised)
and reproduces its formulas exactly: 34sbh + 5as²b; sbh(10 + 24/t + 5as/(ht)) with tp;
(sbh/t)(34 + 5as/h) with tp+sp; 34sbh/t with selective recompute (+sp); 2sbh with full.
`block_terms` is our real block (models/decoder.py, counted as memory.ActivationMeter counts:
one storage once, parameters excluded): norms computed in fp32, flash-style SDPA (saves q, k,
v, output and the log-sum-exp; no s² tensor) or, with attention dropout, an explicit softmax
(its output, 1-byte mask and dropped probabilities), 1-byte masks for the embedding and
residual dropouts, RoPE tables, SwiGLU or GELU MLP.
A test checks it byte for byte against the meter on fake tensors.

Under tp (Megatron-LM) attention heads and the MLP width are split; what lies between the
blocks' all-reduces (norm inputs and statistics) is replicated unless sp splits it along the
sequence. The paper stores the column layers' all-gathered inputs sharded and gathers them
again in backward; our engine keeps them gathered, so those terms are not split by sp.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from shardwise.models import ModelSpec
from shardwise.models.families import family_of
from shardwise.plan.activations_hf import (
    first_block_unsaved,
    hf_block_terms,
    hf_first_block,
    hf_lora_edges,
    hf_norm_terms,
    hf_position_terms,
    weight_readers,
)
from shardwise.plan.terms import CHUNKED_WEIGHT_GRAD, NORMALISED, Term


def paper_gpt_terms(s: int, b: int, h: int, a: int) -> list[Term]:
    """Korthikanti et al. 2022 §4.1: one GPT layer in 16-bit with 1-byte dropout masks."""
    sbh, as2b = s * b * h, a * s * s * b
    return [
        Term("LayerNorm inputs", 4 * sbh, False, True),
        Term("QKV input", 2 * sbh, False, True),
        Term("Q, K", 4 * sbh, True, True),
        Term("softmax output", 2 * as2b, True, True, "not_selective"),
        Term("softmax dropout mask", as2b, True, True, "not_selective"),
        Term("dropout output (attention over V)", 2 * as2b, True, True, "not_selective"),
        Term("V", 2 * sbh, True, True),
        Term("output projection input", 2 * sbh, True, True),
        Term("attention dropout mask", sbh, False, True),
        Term("MLP input", 2 * sbh, False, True),
        Term("GeLU input", 8 * sbh, True, True),
        Term("second linear input", 8 * sbh, True, True),
        Term("MLP dropout mask", sbh, False, True),
    ]


def paper_block_terms(spec: ModelSpec, s: int, b: int, unfused: bool) -> tuple[Term, ...]:
    """`paper_gpt_terms` generalised to the block a 16-bit framework (Megatron-LM, llm-foundry,
    torchtitan) runs: the attention's s x s tensors only when it is unfused (FlashAttention
    saves q, k, v, the output and row statistics only), dropout masks only with dropout,
    grouped k/v heads, and a SwiGLU MLP's two activation inputs. Used for published runs of
    other frameworks (`peers.Deviations.block_memory = "paper"`); our engine's block is
    `block_terms`."""
    sbh, sbf, as2b = s * b * spec.dim, s * b * spec.ffn_dim, spec.n_heads * s * s * b
    sbq = s * b * spec.q_dim  # the heads' width: h unless model.head_dim
    kv = spec.n_kv_heads / spec.n_heads
    out = [
        Term("LayerNorm inputs", 4 * sbh, False, True),
        Term("QKV input", 2 * sbh, False, True),
        Term("Q, K", 2 * sbq * (1 + kv), True, True),
        Term("V", 2 * sbq * kv, True, True),
        Term("output projection input", 2 * sbq, True, True),
        Term("MLP input", 2 * sbh, False, True),
        Term("activation input", (4 if family_of(spec).block.gated_mlp else 2) * sbf, True, True),
        Term("second linear input", 2 * sbf, True, True),
    ]
    if unfused or spec.attn_dropout:
        out.append(Term("softmax output", 2 * as2b, True, True, "not_selective"))
    if spec.attn_dropout:
        out += [
            Term("softmax dropout mask", as2b, True, True, "not_selective"),
            Term("dropout output (attention over V)", 2 * as2b, True, True, "not_selective"),
        ]
    if spec.dropout:
        out += [Term(f"{w} dropout mask", sbh, False, True) for w in ("attention", "MLP")]
    return tuple(out)


def linears(spec: ModelSpec) -> list[tuple[str, int, int, bool]]:
    """(name, fan-in, fan-out, column-parallel) of a block's linear layers in forward order
    (Llama: q, k, v, the output projection, gate, up, down; GPT: no gate)."""
    h, f = spec.dim, spec.ffn_dim
    q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    out = [("wq", h, q, True), ("wk", h, kv, True), ("wv", h, kv, True), ("wo", q, h, False)]
    if family_of(spec).block.gated_mlp:
        return [*out, ("w1", h, f, True), ("w3", h, f, True), ("w2", f, h, False)]
    return [*out, ("w1", h, f, True), ("w2", f, h, False)]


def op_sac_terms(spec: ModelSpec, s: int, b: int, c: int) -> tuple[Term, ...]:
    """A block under torchtitan's per-op selective checkpointing (its `_apply_ac_to_transformer
    _block` with selective_ac_option "op", the llama3 configs' default): the checkpoint keeps
    the block's input and the outputs of the ops on its save list, every other matmul (the
    1st, 3rd, ... in forward order, a count restarted per block) and the fused attention
    (output and log-sum-exp); everything else is recomputed in backward. A row-parallel
    output (before its all-reduce) is whole on every tp rank."""
    sb = s * b
    out = [Term("block input", c * sb * spec.dim, False, True)]
    for name, _, width, column in linears(spec)[::2]:
        out.append(Term(f"{name} output", c * sb * width, column, False))
    out.append(Term("attention output", c * sb * spec.n_heads * spec.head_dim, True, False))
    out.append(Term("attention log-sum-exp", 4 * sb * spec.n_heads, True, False))
    return tuple(out)


def norm_terms(spec: ModelSpec, s: int, b: int, c: int, where: str) -> list[Term]:
    """A norm computed in fp32 (models/decoder.py): its fp32 input, statistics, fp32 weight
    copies (16-bit compute only), the normalised value (RMSNorm) and the output in compute
    dtype (the next matmul's input); transformers' own norms: activations_hf.hf_norm_terms."""
    if family_of(spec).block.transformers:
        return hf_norm_terms(spec, s, b, c, where)
    sbh, h = s * b * spec.dim, spec.dim
    out = [Term(f"{where} input (fp32)", 4 * sbh, False, True)]
    if family_of(spec).block.layer_norm:
        out.append(Term(f"{where} mean, rstd", 8 * s * b, False, True))
        if c != 4:
            out.append(Term(f"{where} weight, bias (fp32 copies)", 8 * h, False, False))
    else:
        out.append(Term(f"{where} rstd", 4 * s * b, False, True))
        if c != 4:
            out.append(Term(f"{where} weight (fp32 copy)", 4 * h, False, False))
        out.append(Term(f"{where} normalised (fp32)", 4 * sbh, False, True))
    # the next column-parallel matmul's input: with sp, parallel/tensor.py keeps the
    # all-gathered copy for the weight gradient (instead of the paper's re-gather in backward)
    out.append(Term(f"{where} output", c * sbh, False, False))
    return out


@lru_cache(maxsize=4096)
def block_terms(spec: ModelSpec, s: int, b: int, c: int, packed: bool = False) -> tuple[Term, ...]:
    """Our block (models/decoder.Block) in compute dtype of `c` bytes; `packed` rows
    (models/packing.py) rotate each sample by its own positions. transformers' own blocks
    (the hf-* presets): activations_hf.hf_block_terms."""
    if family_of(spec).block.transformers:
        return hf_block_terms(spec, s, b, c, packed)
    sbh, sbf = s * b * spec.dim, s * b * spec.ffn_dim
    sbq = s * b * spec.q_dim  # q, k/v repeated to n_heads, and the output: n_heads · head_dim
    kv = spec.n_kv_heads / spec.n_heads
    block = family_of(spec).block
    out = norm_terms(spec, s, b, c, "attn_norm")
    if block.rotary:  # cos/sin tables for q and k, fp32 [(b,) s, head_dim] each
        rope = 4 * 4 * s * spec.head_dim * (b if packed else 1)
        out.append(Term("RoPE tables", rope, False, False, "not_selective"))
    out.append(Term("SDPA q, k, v", 3 * c * sbq, True, False, "not_selective"))
    if spec.attn_dropout:  # the explicit softmax (models/decoder.AttentionCore._explicit)
        as2b = spec.n_heads * s * s * b
        out += [
            Term("softmax output", c * as2b, True, False, "not_selective"),
            Term("attention dropout mask", as2b, True, False, "not_selective"),
            Term("dropped probabilities", c * as2b, True, False, "not_selective"),
        ]
    else:
        out.append(Term("SDPA log-sum-exp", 4 * b * spec.n_heads * s, True, False, "not_selective"))
    out.append(Term("attention output (wo input)", c * sbq, True, False))
    if block.rotary:  # the checkpointed core saves its inputs: q and un-repeated k, v
        out.append(
            Term("core inputs q, k, v", c * sbq * (1 + 2 * kv), True, False, "selective_only")
        )
    else:  # GPT-2's q, k, v are the core's inputs either way
        out.append(Term("core inputs q, k, v", 3 * c * sbq, True, False, "selective_only"))
    out += norm_terms(spec, s, b, c, "mlp_norm")
    if block.gated_mlp:
        out += [
            Term("w1, w3 outputs", 2 * c * sbf, True, False),
            Term("silu(w1 x)", c * sbf, True, False, "not_selective"),
            Term("w2 input", c * sbf, True, False),
        ]
    else:
        out += [Term("GELU input", c * sbf, True, False), Term("w2 input", c * sbf, True, False)]
    if spec.dropout:  # 1-byte masks on both residual branches, split like the hidden states
        out += [Term(f"{where} dropout mask", sbh, False, True) for where in ("attention", "MLP")]
    return tuple(out)


def lora_terms(
    terms,
    spec: ModelSpec,
    s: int,
    b: int,
    c: int,
    targets,
    rank: int,
    dropout: bool,
    selective: bool = False,
) -> tuple[Term, ...]:
    """`terms` of a LoRA run (finetune/lora.py): every base weight frozen, so what only their
    gradients read is not saved (a norm's normalised input; a linear's input unless its
    adapter reads it; under `selective` recomputation also the recomputed core's output);
    each adapter saves A's output (B's input, rank wide) and, with dropout, its own 1-byte
    mask and dropped input (A's input) instead of the shared one."""
    out = []
    for term in terms:
        if term.name.endswith(NORMALISED) or term.name == CHUNKED_WEIGHT_GRAD:
            continue
        readers = weight_readers(spec, term.name, selective)
        if readers is not None and (dropout or not set(readers) & set(targets)):
            continue
        out.append(term)
    if not targets:  # the edges: the head is frozen and has no adapter, the frozen
        out = [term for term in out if term.name != "embedding dropout mask"]  # (no gradient)
        return hf_lora_edges(spec, s, b, c, out)  # embeddings save no ids
    q = spec.n_heads * spec.head_dim
    width = {"wq": spec.dim, "wk": spec.dim, "wv": spec.dim, "wqkv": spec.dim, "wo": q}
    width.update(w1=spec.dim)
    width.update(w3=spec.dim, w2=spec.ffn_dim, router=spec.dim)  # (an MoE layer's router)
    for x in targets:
        out.append(Term(f"{x} adapter A output", c * s * b * rank, False, False))
        if dropout:  # row-parallel layers (wo, w2) read a tp-split input
            row = x in ("wo", "w2")
            out.append(Term(f"{x} adapter input, mask", (c + 1) * s * b * width[x], row, False))
    return tuple(out)


def lora_first_block(
    spec: ModelSpec,
    s: int,
    b: int,
    targets,
    dropout: bool,
    c: int = 2,
    packed: bool = False,
    alone: bool = False,
    selective: bool = False,
) -> tuple[Term, ...]:
    """What the first adapted block does not save in a LoRA run (negative terms): its input
    has no gradient (the frozen embedding's, or unadapted blocks'), so nothing before its first
    adapted linear saves anything (activations_hf.first_block_unsaved; under `selective`
    recomputation but the recomputed regions' inputs), and with RoPE only the adapted q or k
    keeps its rotation's tables. transformers' blocks: activations_hf.hf_first_block (`alone`:
    no block runs after it)."""
    if family_of(spec).block.transformers:
        return hf_first_block(spec, s, b, c, targets, packed, dropout, alone)
    block = block_terms(spec, s, b, c, packed)
    out = first_block_unsaved(spec, s, b, block, targets, dropout, selective)
    out += _explicit_attention_unsaved(spec, block, targets)
    if spec.dropout and not {"wq", "wk", "wv", "wo"} & set(targets):  # (the last terms)
        # the attention branch's residual dropout: its input has no gradient, no mask
        out += (Term("first block attention dropout mask", -s * b * spec.dim, False, True),)
    rope = [term for term in block if term.name == "RoPE tables"]
    before = any(term.name == "first block RoPE tables" for term in out)  # all left out
    unrotated = 2 - len({"wq", "wk"} & set(targets))  # q's cos/sin and k's
    if rope and not before and unrotated:  # a rotation without a gradient saves neither
        cut = -rope[0].nbytes * unrotated // 2
        out += (replace(rope[0], name="first block RoPE tables", nbytes=cut),)
    return out


def _explicit_attention_unsaved(spec: ModelSpec, block: tuple[Term, ...], targets) -> tuple:
    """What the explicit softmax (model.attn_dropout: models/decoder.AttentionCore._explicit)
    of a first block with some of q, k, v adapted does not save, as negative terms: q @ kᵀ
    keeps q for k's gradient and k for q's, the softmax its output and mask only with either,
    probs @ v the dropped probabilities for v's gradient and v for theirs. Without a q, k or v
    adapter that attention saves nothing (`first_block_unsaved`)."""
    q, k, v = ({x} & set(targets) for x in ("wq", "wk", "wv"))
    if not spec.attn_dropout or not (q or k or v):
        return ()
    named = {}
    for term in block:  # the first "attention dropout mask" is the softmax's (then residual's)
        named.setdefault(term.name, term)
    kept = bool(k) + bool(q) + bool(q or k)  # q, k, v (each a third of the term)
    out = [replace(named["SDPA q, k, v"], nbytes=named["SDPA q, k, v"].nbytes * (3 - kept) / 3)]
    if not (q or k):
        out += [named["softmax output"], named["attention dropout mask"]]
    if not v:
        out.append(named["dropped probabilities"])
    return tuple(replace(x, name=f"first block {x.name}", nbytes=-x.nbytes) for x in out)


def layer_bytes(terms, t: int = 1, sp: bool = False, selective: bool = False) -> float:
    return sum(term.per_rank(t, sp, selective) for term in terms)


def full_recompute_bytes(spec: ModelSpec, s: int, b: int, c: int, t: int, sp: bool) -> float:
    """Full recomputation keeps only each block's input (2sbh in 16-bit), split by sp."""
    return c * s * b * spec.dim / (t if sp else 1)


@lru_cache(maxsize=4096)
def edge_terms(
    spec: ModelSpec,
    s: int,
    b: int,
    c: int,
    first: bool,
    last: bool,
    tp: int = 1,
    packed: bool = False,
    fused_loss: bool = False,
    loss_chunks: int = 0,
) -> tuple[Term, ...]:
    """Outside the blocks: token ids (a view of the (b, s+1) window the loader reads, shared
    with the targets), learned positions, the final norm, fp32 log-softmax of the logits
    (split by a vocabulary-parallel loss), the flattened targets and the loss's weight sum.
    With tp the embedding and the loss are vocabulary-parallel (parallel/tensor.py): each saves
    its shifted ids (int64) and a mask of the ids it owns (bool) instead (the loss also a mask
    of the targets that count). Packed rows (models/packing.py) come as [b, 2, s] ids and
    record numbers, their targets apart, and one additive attention mask [b, 1, s, s] in
    compute dtype that every layer's attention shares. With `loss_chunks` > 1
    (models/chunked_loss.py, tp = 1) the head keeps the gradients it made in forward instead:
    of its input ([tokens, dim], in place of the norm output) and of its weight ([vocab, dim]);
    no logits, no targets."""
    out = _input_terms(spec, s, b, c, tp, packed) if first else []
    if last:
        out += _output_terms(spec, s, b, c, first, tp, packed, fused_loss, loss_chunks)
    return tuple(out)


def _input_terms(spec: ModelSpec, s: int, b: int, c: int, tp: int, packed: bool) -> list[Term]:
    """`edge_terms` of the stage with the embedding: ids, packed rows' mask, positions and the
    embedding's dropout mask."""
    out = []
    if packed:
        out.append(Term("attention mask of the packed records", c * b * s * s, False, False))
    if tp == 1:
        ids = 16 * b * s if packed else 8 * b * (s + 1)
        out.append(Term("token ids", ids, False, False))
    else:
        out.append(Term("local token ids and mask", 9 * b * s, False, False))
    if family_of(spec).block.transformers:  # made once, not per layer
        out += hf_position_terms(spec, s, b, c, packed)
    elif family_of(spec).block.learned_positions:
        out.append(Term("position ids", 8 * s, False, True))
    if spec.dropout:
        out.append(Term("embedding dropout mask", s * b * spec.dim, False, True))
    return out


def _output_terms(
    spec: ModelSpec,
    s: int,
    b: int,
    c: int,
    first: bool,
    tp: int,
    packed: bool,
    fused_loss: bool,
    loss_chunks: int,
) -> list[Term]:
    """`edge_terms` of the stage with the head: the final norm, the logits' log-softmax (or the
    chunked loss's gradients), the targets and the loss's weight sum."""
    out = []
    if loss_chunks > 1:
        norm = norm_terms(spec, s, b, c, "final norm")
        out += [term for term in norm if term.name != "final norm output"]
        out += [
            Term("head input gradient (chunked loss)", c * s * b * spec.dim, False, False),
            Term(CHUNKED_WEIGHT_GRAD, c * spec.vocab_size * spec.dim, False, False),
        ]
    else:
        out += norm_terms(spec, s, b, c, "final norm")
        v = -(-spec.vocab_size // tp) * tp  # padded to a multiple of tp
        if fused_loss:  # flash-attn's cross entropy keeps the 16-bit logits (peers.Deviations)
            out.append(Term("logits (fused loss)", c * s * b * v, True, False))
        else:
            out.append(Term("log-softmax (fp32)", 4 * s * b * v, True, False))
        if tp == 1:
            # targets are a view of the loader's (b, s+1) window: flattening copies it, except
            # for one sample, where the flat view keeps the window itself (already held as the
            # token ids when this stage is also the first)
            targets = 8 * s * b if (b > 1 or packed) else (0 if first else 8 * (s + 1))
            out += [
                Term("targets (flattened)", targets, False, False),
                Term("loss weight sum", 4, False, False),
            ]
        else:
            # shifted targets (int64), the ids this rank owns and the kept (not -100) ones (bool)
            out.append(Term("local targets and masks", 10 * s * b, False, False))
    return out


def in_flight(schedule: str, p: int, m: int, v: int, stage: int = 0) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak, in units of the
    stage's layers. GPipe: all m. 1F1B: p - stage, at most m. ZB-H1 (Qi et al. 2024): p on
    every stage, at most m (the first stage's 1F1B peak: a later stage keeps a micro-batch
    from its input-gradient pass until its deferred weight-gradient pass). Interleaved
    (Narayanan et al. 2021 §2.2): (p-stage-1)·2 + (v-1)·p + 1 model chunks of L/(pv) layers,
    i.e. L(1 + (p-1)/(pv)) layers on the first stage."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        if m == p:  # no steady state: every forward runs first (as Megatron-LM's)
            return float(m)
        chunks = min(m * v, (p - stage - 1) * 2 + (v - 1) * p + 1)
        return chunks / v
    return float(min(m, p if schedule == "zb" else p - stage))
