"""A GPU's compute time for one micro-batch, kernel by kernel, instead of one flat efficiency.

Every matrix multiply of a block (per tensor-parallel shard) is priced by a roofline: the
larger of its FLOPs at the GEMM efficiency and its bytes at the achieved memory bandwidth
(Williams et al. 2009), plus a fixed cost per kernel (launch and the last partial wave) that
small shards and small micro-batches do not amortise. Attention is one fused kernel
(FlashAttention-2, Dao 2023: causal masking skips half the score blocks; backward re-computes
the scores, 2.5x the forward's FLOPs) unless the model has attention dropout or the framework
that runs it does not fuse attention (peers.Deviations.unfused_attention): then it is Megatron-LM's
path, two batched GEMMs over the whole s x s square and the scale-mask-softmax (and dropout)
kernels reading and writing it. Element-wise work (norms, residual adds, activations, dropout,
RoPE) is memory-bound: its bytes at the achieved bandwidth, counted kernel by kernel for
forward and backward. Backward runs two GEMMs per forward one.

Parameters (hardware.py): `matmul_eff` (large-GEMM efficiency), `attn_eff` (fused attention's
efficiency), `mem_eff` (achieved / peak HBM bandwidth), `kernel_s` (fixed seconds per
kernel); calibrated on published runs (benchmarks/published_runs.py).
"""

from __future__ import annotations

from shardwise.errors import ConfigError
from shardwise.models.families import family_of
from shardwise.plan import activations as act
from shardwise.plan import moe, peers
from shardwise.plan.eager import block_bytes as eager_bytes
from shardwise.plan.hardware import Hardware

# 16-bit Tensor Cores want every GEMM dimension a multiple of 16 bytes (NVIDIA, "Matrix
# Multiplication Background", Tensor Core requirements); cuBLAS runs the others on slower paths
ALIGN = 8  # elements of 2 bytes


def misaligned(spec, tp: int = 1) -> dict[str, int]:
    """A transformer's GEMM dimensions on one tp rank that are not multiples of ALIGN, by
    name (the unfused attention prices its head dim's: `_attention`)."""
    if not family_of(spec).gemms or not (spec.dim and spec.n_heads):
        return {}
    dims = {
        "head dim": spec.head_dim,
        "width per tp rank": spec.dim // tp,
        "ffn per tp rank": spec.ffn_dim // tp,
    }
    return {name: n for name, n in dims.items() if n % ALIGN}


def _gemm(hw: Hardware, c: int, m: float, n: float, k: float, peak: float) -> float:
    """Seconds of one (m x k) @ (k x n) multiply in `c`-byte elements."""
    flops = 2.0 * m * n * k
    moved = c * (m * k + k * n + m * n)
    return max(flops / (peak * hw.matmul_eff), moved / (hw.hbm_bw * hw.mem_eff)) + hw.kernel_s


def _gemms(spec, t: int, tokens: float, ep: int = 1) -> list[tuple[float, float, float]]:
    """(m, n, k) of a block's linear layers on one tensor-parallel rank, in forward order; an
    MoE block's MLP is its router, experts and shared experts (plan/moe.py) on one of `ep`."""
    h, f, hd = spec.dim, spec.ffn_dim, spec.head_dim
    qkv = (spec.n_heads + 2 * spec.n_kv_heads) * hd
    attention = [(tokens, qkv / t, h), (tokens, h, spec.q_dim / t)]  # q, k, v; the output
    if moe.is_moe(spec):
        return [*attention, *moe.mlp_gemms(spec, t, tokens, ep)]
    if family_of(spec).block.gated_mlp:  # SwiGLU: gate and up, then down
        return [*attention, (tokens, f / t, h), (tokens, f / t, h), (tokens, h, f / t)]
    return [*attention, (tokens, f / t, h), (tokens, h, f / t)]


def _elementwise_seconds(
    hw: Hardware,
    spec,
    t: int,
    tokens: float,
    c: int,
    sp: bool,
    backward: bool = False,
    excess: float = 0.0,
) -> float:
    """Seconds of a block's element-wise kernels in forward (or `backward`): the elements
    they read + write at the achieved bandwidth, and a fixed cost each. Norms and residual adds
    act on the whole hidden state (1/t of it with sp), the MLP's activation on this rank's 1/t
    of the width. Backward, kernel by kernel: a norm reads its input and the gradient and
    writes one (3 passes to the forward's 2); a residual add passes its gradient on untouched,
    a bias sums it (1 read), dropout reads it with its mask and writes one (2 + the mask);
    GELU reads its input and the gradient and writes one (3 to 2), SwiGLU reads gate, up and
    the gradient and writes two (5 to 3), RoPE rotates the gradients back (2 to 2). An MoE
    block's SwiGLU runs on its routed rows and shared experts, and its routing adds
    moe.routing_bytes. This is the fused count (a compiled block, or hand-fused kernels);
    `excess`: plus that many times what the eager count (each op of the module's code its own
    kernel: plan/eager.py) costs beyond it (peers.elementwise_excess); a negative `excess`
    (our compiled blocks) takes at most all of it off, never below nothing."""
    if excess:
        fused = _elementwise_seconds(hw, spec, t, tokens, c, sp, backward)
        eager = _eager_seconds(hw, spec, t, tokens, c, sp, backward)
        return max(0.0, fused + excess * (eager - fused))
    h, f = spec.dim, moe.act_width(spec)
    routing, routing_kernels = moe.routing_bytes(spec, tokens, c, backward)
    spec = moe.dense_spec(spec)  # norms, residuals and RoPE as the dense decoder's
    bw = hw.hbm_bw * hw.mem_eff
    hidden = tokens * h / (t if sp else 1)
    elems = 2 * (3 if backward else 2) * hidden  # two norms
    if backward:  # two residual adds, each with its bias (and dropout)
        elems += 2 * (2.5 if spec.dropout else 1) * hidden
    else:  # two residual adds (with bias and dropout where the model has them)
        elems += 2 * 3 * hidden
        if spec.dropout:
            elems += 2 * 1.5 * hidden  # their dropout masks written and applied
    kernels = 6
    block = family_of(spec).block
    if block.gated_mlp:
        elems += (5 if backward else 3) * tokens * f / t  # silu(gate) * up
        kernels += 2
    else:
        elems += (3 if backward else 2) * tokens * f / t  # bias + GELU
        kernels += 1
    if block.rotary:
        kv = spec.n_kv_heads / spec.n_heads
        elems += 2 * tokens * spec.q_dim * (1 + kv) / t  # RoPE on q and k
        kernels += 1
    kernels += routing_kernels
    return (c * elems + routing) / bw + kernels * hw.kernel_s


def _eager_seconds(
    hw: Hardware, spec, t: int, tokens: float, c: int, sp: bool, backward: bool
) -> float:
    """`_elementwise_seconds` by the eager count: each op of the module's code its own kernel
    (plan/eager.py), an MoE block's routing as in the fused count."""
    routing, routing_kernels = moe.routing_bytes(spec, tokens, c, backward)
    f, dense = moe.act_width(spec), moe.dense_spec(spec)
    moved, kernels = eager_bytes(dense, f, t, tokens, c, sp, backward)
    bw = hw.hbm_bw * hw.mem_eff
    return (moved + routing) / bw + (kernels + routing_kernels) * hw.kernel_s


def _attention(hw: Hardware, spec, t, b, s, c, peak, unfused: bool) -> tuple:
    """(forward, backward) seconds of the attention core on one tensor-parallel rank."""
    heads, hd = spec.n_heads / t, spec.head_dim
    if not (spec.attn_dropout or unfused):  # fused, causal: half of the 4·b·s²·d FLOPs per head
        fwd_flops = 4.0 * b * heads * s * s * hd / 2
        fwd = fwd_flops / (peak * hw.attn_eff) + hw.kernel_s
        return fwd, 2.5 * (fwd - hw.kernel_s) + hw.kernel_s
    # unfused (Megatron-LM's softmax path): QK^T and AV batched GEMMs over the whole square,
    # the fused scale-mask-softmax (read + write) and, with attention dropout, the dropout
    # (read, write, a 1-byte mask)
    gemm = 2 * _gemm(hw, c, s, s, hd, peak) - 2 * hw.kernel_s
    if c == 2 and hd % ALIGN:  # a head dim off the 16-bit Tensor Cores' alignment
        gemm *= hw.misaligned_slowdown
    square = b * heads * s * s
    bw = hw.hbm_bw * hw.mem_eff
    drop = 1 if spec.attn_dropout else 0
    fwd = b * heads * gemm + square * (2 * c + drop * (2 * c + 1)) / bw
    # backward: 4 GEMMs; softmax backward reads 2 squares and writes 1, dropout's 1 and a mask
    bwd = 2 * b * heads * gemm + square * (3 * c + drop * (2 * c + 1)) / bw
    kernels = 3 + drop  # the two batched GEMMs, the softmax (and the dropout)
    return fwd + kernels * hw.kernel_s, bwd + (4 + 1 + drop) * hw.kernel_s


def backward_gemm_seconds(
    hw: Hardware, spec, t: int, tokens: float, c: int, peak: float, ep: int = 1
):
    """(input-gradient, weight-gradient) seconds of a block's linear layers in backward."""
    dgrad = sum(_gemm(hw, c, m, k, n, peak) for m, n, k in _gemms(spec, t, tokens, ep))
    return dgrad, _weight_grad(hw, spec, t, tokens, c, peak, ep)


def block_seconds(
    hw: Hardware,
    spec,
    t,
    b,
    s,
    c,
    sp: bool,
    peak: float,
    unfused: bool = False,
    linear=None,
    ep: int = 1,
    excess: float = 0.0,
):
    """(forward, backward, attention forward) seconds of one block for a micro-batch of `b`
    sequences of `s` tokens on one tensor-parallel rank; `linear`: the linear layers' peak
    FLOP/s where it is not `peak` (precision.fp8: `linear_peak`); `ep`: the expert-parallel
    degree an MoE block's experts are split over; `excess`: the element-wise ops' share of the
    eager count beyond the fused one (peers.elementwise_excess)."""
    tokens, linear = b * s, linear or peak
    gemm = sum(_gemm(hw, c, *g, linear) for g in _gemms(spec, t, tokens, ep))
    # backward: the input gradient and the weight gradient, each as big as the forward GEMM
    gemm_bwd = sum(backward_gemm_seconds(hw, spec, t, tokens, c, linear, ep))
    ew = _elementwise_seconds(hw, spec, t, tokens, c, sp, excess=excess)
    ew_bwd = _elementwise_seconds(hw, spec, t, tokens, c, sp, backward=True, excess=excess)
    attn_f, attn_b = _attention(hw, spec, t, b, s, c, peak, unfused)
    return gemm + ew + attn_f, gemm_bwd + ew_bwd + attn_b, attn_f


def op_recompute_seconds(
    hw: Hardware, spec, t, b, s, c, sp: bool, peak: float, excess: float = 0.0
) -> float:
    """What per-op selective checkpointing (activations.op_sac_terms) runs again in backward:
    the matmuls it did not keep (every second one) and the forward's element-wise kernels."""
    tokens = b * s
    redo = sum(
        _gemm(hw, c, tokens, n / t if column else n, k if column else k / t, peak)
        for _, k, n, column in act.linears(spec)[1::2]
    )
    return redo + _elementwise_seconds(hw, spec, t, tokens, c, sp, excess=excess)


def head_seconds(hw: Hardware, spec, t: int, tokens: float, c: int, peak: float) -> float:
    """The output layer forward + backward and the (vocabulary-parallel) cross-entropy:
    three GEMMs and the fp32 logits read and written a few times."""
    v = -(-spec.vocab_size // t)
    gemm = _gemm(hw, c, tokens, v, spec.dim, peak)
    gemm += _gemm(hw, c, tokens, spec.dim, v, peak) + _gemm(hw, c, spec.dim, v, tokens, peak)
    loss = tokens * v * (c + 4 * 4) / (hw.hbm_bw * hw.mem_eff) + 4 * hw.kernel_s
    return gemm + loss


def linear_peak(hw: Hardware, job) -> float:
    """Peak FLOP/s of the blocks' linear layers: the card's FP8 peak under precision.fp8 (an
    assumption: the GEMMs' FLOPs at FP8 rate and their bytes still at the compute dtype's
    width, the casts' extra reads of each operand left unpriced), else the compute dtype's."""
    if job.fp8 == "none":
        return hw.peak[job.precision]
    if job.precision != "bf16":  # as training refuses it (parallel/fp8.py)
        raise ConfigError(
            f"precision.fp8={job.fp8} with precision.compute={job.precision}: FP8 training "
            "keeps bf16 activations. Fix: --precision.compute=bf16."
        )
    if "fp8" not in hw.peak:
        raise ConfigError(
            f"precision.fp8={job.fp8}: {hw.name} has no FP8 tensor cores (compute capability "
            "8.9+: H100, H200, B200, L40S, RTX 4090). Fix: --precision.fp8=none, or a card "
            "that has them."
        )
    return hw.peak["fp8"]


def layer_seconds(hw: Hardware, job, layout) -> float:
    """Forward + backward (+ recomputation) of one block for one micro-batch; an MoE model's
    blocks averaged over its MoE and dense ones (plan/moe.py)."""
    spec = job.spec
    if not moe.is_moe(spec):
        return _layer_seconds(hw, job, layout, spec)
    share = moe.moe_share(spec)
    dense = _layer_seconds(hw, job, layout, moe.dense_spec(spec)) if share < 1 else 0.0
    return share * _layer_seconds(hw, job, layout, spec) + (1 - share) * dense


def _layer_seconds(hw: Hardware, job, layout, spec) -> float:
    """`layer_seconds` of one block shaped as `spec`."""
    s, b, t = job.seq_len, layout.micro_batch, layout.tp
    peak, linear = hw.peak[job.precision], linear_peak(hw, job)
    unfused, excess = peers.of(job).unfused_attention, peers.elementwise_excess(job)
    fwd, bwd, attn = block_seconds(
        hw, spec, t, b, s, job.bc, layout.sp, peak, unfused, linear, layout.ep, excess
    )
    redo = {"full": fwd, "selective": attn}.get(layout.recompute, 0.0)
    if layout.recompute == "selective" and peers.of(job).selective_ops:
        redo = op_recompute_seconds(hw, spec, t, b, s, job.bc, layout.sp, linear, excess)
    per_layer = fwd + bwd + redo
    if job.finetune.lora:  # frozen weights: no weight gradient (a third of the GEMM time)
        per_layer -= _weight_grad(hw, spec, t, b * s, job.bc, linear, layout.ep)
        # the expert adapters train: forward, input and weight gradients (+ full recompute's
        # forward again); a backward GEMM permutes its forward's (m, n, k): the same seconds
        gemms = moe.lora_gemms(spec, job.finetune, t, b * s, layout.ep, job.bc)
        passes = 4 if layout.recompute == "full" else 3
        per_layer += passes * sum(_gemm(hw, job.bc, *g, linear) for g in gemms)
    return per_layer


def micro_batch_seconds(hw: Hardware, job, layout, layers: int) -> float:
    """Forward + backward (+ recomputation) of one micro-batch on the busiest stage: its
    `layers` blocks and the head with the loss."""
    tokens, peak = layout.micro_batch * job.seq_len, hw.peak[job.precision]
    head = head_seconds(hw, job.spec, layout.tp, tokens, job.bc, peak)
    return layers * layer_seconds(hw, job, layout) + head


def _weight_grad(
    hw: Hardware, spec, t: int, tokens: float, c: int, peak: float, ep: int = 1
) -> float:
    """Seconds of a block's weight-gradient GEMMs (what frozen weights skip)."""
    return sum(_gemm(hw, c, k, n, m, peak) for m, n, k in _gemms(spec, t, tokens, ep))


def attention_seconds(hw: Hardware, spec, t, b, s, c, peak, unfused: bool = False) -> tuple:
    """(forward, backward) seconds of one block's attention core for `b` sequences of `s`
    tokens on one tensor-parallel rank (what context parallelism multiplies: plan/context.py)."""
    return _attention(hw, spec, t, b, s, c, peak, unfused)
