"""The bytes a transformer block's element-wise kernels move when eager PyTorch runs them.

plan/gpu.py counts one pass per element-wise op (a norm reads its input and writes its output,
SwiGLU reads gate and up and writes one): what a compiled block runs (`train.compile=blocks`,
TorchInductor fuses each element-wise chain into one kernel), and what frameworks with
hand-fused kernels run (peers.Deviations.fused_elementwise). An engine running plain PyTorch
eagerly launches each op of the module's code as its own kernel, each reading its inputs from
and writing its output to memory. The counts below are read off our modules
(models/decoder.py; the op list is what PyTorch dispatches for them, checked against a trace by
tests/test_plan_eager.py), per block and tensor-parallel rank. X elements of the compute dtype
(c bytes) cast to fp32 (w = 4 bytes) and back cost (c + w)·X each way; at fp32 (c = w) the
casts are no-ops and launch nothing.

Forward:
- RMSNorm / LayerNorm, twice: x.float() (a cast), the norm in fp32 (one kernel: torch's fused
  rms_norm on CUDA, native_layer_norm; reads and writes w·H), .to(x.dtype) (a cast).
- RoPE on q and k (X = their elements), per tensor: x.float(), neg of one half (w·X read +
  written in halves), cat of the halves (2w·X), x·cos and rotated·sin (2w·X each: the tables
  are [s, head_dim], negligible), their add (3w·X), the cast back.
- grouped-query attention: k and v repeated to the query heads (repeat_interleave: read c·K,
  write c·Q each).
- the two residual adds (2 reads, 1 write of c·H each).
- SwiGLU: silu(gate) (read, write) then · up (2 reads, 1 write): 5c·F; GELU: one kernel, 2c·F
  (the bias is added by the GEMM, addmm).
- dropout (spec.dropout), at each of the two sites: x · mask (reads c·H and the 1-byte mask,
  writes c·H), then · 1/(1 − p) (read, write c·H); its per-sample masks are drawn apart from
  the block and counted in neither model.

Backward:
- SwiGLU: the product's two gradients (3c·F each) and silu_backward (3c·F); GELU: 3c·F.
- the norms: the gradient cast to fp32, the fused backward (reads the gradient and the input,
  writes the input gradient: 3w·H), the cast back.
- RoPE, per tensor: the gradient cast to fp32, its products with cos and sin (2w·X each), the
  neg of one half (w·X), the halves cat back (2w·X), the add (3w·X), the cast back.
- grouped-query attention: the repeated heads' gradients summed back (read c·Q, write c·K).
- autograd's gradient sums where a tensor feeds several ops (2 reads, 1 write each): the block
  input and the mid-block state each feed a residual and a branch (c·H each); the attention
  norm's output feeds q, k and v (two sums) and the MLP norm's feeds gate and up (one sum),
  on the whole token-by-width input a tp rank's linears see (c·tokens·h).
- dropout, at each site: the gradient · mask, · 1/(1 − p), as forward.
- biases (GPT-2): each linear's bias gradient sums its output gradient over the tokens (one
  read).

An MoE block's SwiGLU runs on its routed rows and shared experts (moe.act_width), its routing
priced by plan/moe.py as in the fused count.
"""

from __future__ import annotations

from shardwise.models.families import family_of

FP32 = 4


def _cast(c: int, n: float) -> tuple[float, int]:
    """(bytes, kernels) of casting n elements between the compute dtype and fp32."""
    return (0.0, 0) if c == FP32 else ((c + FP32) * n, 1)


def block_bytes(
    spec, width: float, t: int, tokens: float, c: int, sp: bool, backward: bool = False
) -> tuple[float, int]:
    """(bytes, kernels) of one block's eager element-wise work on a tensor-parallel rank, for
    `tokens` tokens, forward or `backward`; `width`: the MLP activation's width per token."""
    block, w = family_of(spec).block, FP32
    h = spec.dim
    hidden = tokens * h / (t if sp else 1)  # norms, residuals and dropout: 1/t under sp
    cast, cast_k = _cast(c, hidden)
    # two norms: the cast in, the fp32 norm (forward 2w·H, backward 3w·H), the cast out
    moved = 2 * (2 * cast + (3 if backward else 2) * w * hidden)
    kernels = 2 * (2 * cast_k + 1)
    moved += 2 * 3 * c * hidden  # forward: the residual adds; backward: their gradient sums
    kernels += 2
    f = tokens * width / t
    if block.gated_mlp:
        moved += (9 if backward else 5) * c * f
        kernels += 3 if backward else 2
    else:
        moved += (3 if backward else 2) * c * f
        kernels += 1
    if spec.dropout:  # two sites: · mask, · 1/(1 - p)
        moved += 2 * (4 * c + 1) * hidden
        kernels += 4
    if backward:  # the norms' outputs feed several linears: their gradients summed
        sums = 3 if block.gated_mlp else 2  # q, k, v: two sums; gate and up: one more
        moved += sums * 3 * c * tokens * h
        kernels += sums
    if backward and block.biases:  # each bias's gradient: its output gradient summed
        qkv = tokens * (spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim / t
        moved += c * (qkv + f + 2 * hidden)  # q, k, v and the MLP's input columns; wo, w2
        kernels += 6
    if block.rotary:
        q = tokens * spec.n_heads * spec.head_dim / t
        k = tokens * spec.n_kv_heads * spec.head_dim / t
        for x in (q, k):
            x_cast, x_kernels = _cast(c, x)
            moved += 2 * x_cast + 10 * w * x  # neg, cat, two products, add (see above)
            kernels += 2 * x_kernels + 5
        if spec.n_kv_heads != spec.n_heads:  # k and v repeated (forward), summed back
            moved += 2 * c * (q + k)
            kernels += 2
    return moved, kernels
