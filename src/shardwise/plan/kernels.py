"""Kernel times measured at a job's own shapes on this CPU: the compute part of the `cpu`
hardware's time model.

A FLOP count over one calibrated rate misses most of a small CPU step: matmuls at a rank's
shapes run at 50-90% of a square matmul's rate depending on the token count and width, and
the element-wise kernels (norms, RoPE, SwiGLU, softmax, casts, the loss) and the per-kernel
dispatch cost are as large as the matmuls at these sizes. So, as profile-guided planners do
(Alpa, Zheng et al. 2022 §6; Galvatron, Miao et al. 2022 §4), the planner times the real
modules at the shapes a rank would run: one decoder block forward + backward with the rank's
tensor-parallel shard of every linear layer, the output head with the loss, and the AdamW
step per element. Communication, the pipeline bubble and offload stay analytical (time.py).

Times are per-thread CPU seconds (ranks run one intra-op thread each, device.set_cpu_threads),
the median of a few repetitions after a warm-up, kept per shape and machine in
`$SHARDWISE_CACHE/kernels-cpu.json` beside the calibration. Blocks whose
forward + backward would take more than a few seconds here are not run (`None`): the caller
falls back to the FLOP model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import sys
import time

import torch
from torch import nn

from shardwise.distributed.device import dtype_of
from shardwise.plan.cache import cache_file, machine_key, one_thread
from shardwise.plan.shapes import linear_shapes

MAX_FLOPS = 2e10  # per measured call: ~0.2-1 s on one core; larger shapes use the FLOP model


CACHE = "kernels-cpu.json"
_memo: dict[str, float | None] | None = None


def _read() -> dict[str, float | None]:
    try:
        return json.loads(cache_file(CACHE).read_text()).get(machine_key(), {})
    except (OSError, ValueError, AttributeError):
        return {}


def _stored() -> dict[str, float | None]:
    global _memo
    if _memo is None:
        _memo = _read()
    return _memo


def _save(merge: bool = True) -> None:
    """Write this process's times; `merge` keeps those other processes wrote meanwhile."""
    path, key = cache_file(CACHE), machine_key()
    try:
        everything = json.loads(path.read_text()) if path.exists() else {}
        kept = everything.get(key, {}) if merge else {}
        everything[key] = {**kept, **_stored()}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(everything, indent=1))
    except (OSError, ValueError):
        pass  # an unwritable cache only costs a re-measurement next time


def _cached(fn):
    """Measure each shape once per machine: kept in memory and in `$SHARDWISE_CACHE`
    (`plan` times every candidate's shapes; a second plan, or another process, reuses them,
    so every prediction of one layout uses the same times)."""

    @functools.wraps(fn)
    def wrapper(*args):
        key = f"{fn.__name__}{args!r}"
        memo = _stored()
        if key not in memo:
            memo.update({k: v for k, v in _read().items() if k not in memo})  # other processes'
        if key not in memo:
            if not memo:
                print(
                    f"(timing the layouts' blocks on this CPU once; kept in {cache_file(CACHE)})",
                    file=sys.stderr,
                )
            memo[key] = fn(*args)
            _save()
        return memo[key]

    return wrapper


def _seconds(fn, reps: int = 5, budget: float = 0.6) -> float:
    """Median CPU seconds of `fn` on this thread over up to `reps` runs within `budget`."""
    fn()  # warm-up: allocations, kernel selection
    times: list[float] = []
    spent = 0.0
    while len(times) < reps and (len(times) < 3 or spent < budget):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
        spent += times[-1]
    return statistics.median(times)


def _shard(block: nn.Module, spec, t: int) -> nn.Module:
    """The block as a tp rank holds it: every linear layer at its shard's (fan_in, fan_out)
    (shapes.linear_shapes, which the memory model checks against the engine; q/k/v and the
    MLP's input projections by columns, the output projections by rows). The attention views
    take the head count from the shapes, so the narrowed block runs as a shard does."""
    if t == 1:
        return block
    shapes = linear_shapes(spec, t)
    if spec.n_kv_heads % t:  # replicated k/v projections: a rank attends with one kv head
        # (the projection's extra width, a small share of the block, is not timed)
        shapes["wk"] = shapes["wv"] = (spec.dim, spec.head_dim)
    for name, (fan_in, fan_out) in shapes.items():
        owner = block.attn if name in ("wq", "wk", "wv", "wo") else block.mlp
        old = getattr(owner, name)
        setattr(owner, name, nn.Linear(fan_in, fan_out, bias=old.bias is not None))
    return block


@_cached
def block_seconds(spec, tp: int, tokens: int, seq_len: int, precision: str, recompute: str):
    """CPU seconds of one block's forward + backward (with `recompute`) on a tp rank for a
    micro-batch of `tokens` tokens, or None when the shape is too large to time here."""
    from shardwise.models.decoder import Block
    from shardwise.models.families import family_of
    from shardwise.parallel.recompute import apply_recompute

    flops = 6.0 * 12 * spec.dim * spec.dim * tokens / tp  # a rough size test only
    if flops > MAX_FLOPS or not family_of(spec).formula:
        return None
    b = max(1, tokens // seq_len)
    dtype = dtype_of(precision)
    with one_thread():
        holder = nn.Module()
        plain = dataclasses.replace(spec, dropout=0.0, attn_dropout=0.0)
        holder.blocks = nn.ModuleList([_shard(Block(plain), plain, tp)])
        holder.to(dtype)
        apply_recompute(holder, family_of(spec), recompute)
        x = torch.randn(b, seq_len, spec.dim, dtype=dtype, requires_grad=True)

        def step() -> None:
            holder.blocks[0](x).float().sum().backward()

        return _seconds(step)


@_cached
def head_seconds(dim: int, vocab: int, tokens: int, precision: str) -> float | None:
    """CPU seconds of the final norm, the output head (a tp rank's vocabulary slice) and the
    cross-entropy loss, forward + backward, plus the embedding lookup and its gradient."""
    if 6.0 * dim * vocab * tokens > MAX_FLOPS:
        return None
    dtype = dtype_of(precision)
    with one_thread():
        embed = nn.Embedding(vocab, dim).to(dtype)
        norm = nn.RMSNorm(dim).to(dtype)
        head = nn.Linear(dim, vocab, bias=False).to(dtype)
        ids = torch.randint(0, vocab, (tokens,))
        targets = torch.randint(0, vocab, (tokens,))

        def step() -> None:
            h = embed(ids)
            logits = head(norm(h)).float()
            torch.nn.functional.cross_entropy(logits, targets).backward()

        return _seconds(step)


@_cached
def optimizer_seconds_per_element(n: int = 1 << 21, tensors: int = 16) -> float:
    """CPU seconds per fp32 element of optim.py's step: the norm for clipping
    (optim.squared_norm), the clip multiply and torch's fused AdamW (measured on `tensors`
    tensors of n elements)."""
    from shardwise.optim import squared_norm

    with one_thread():
        params = [torch.zeros(n // tensors, requires_grad=True) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        grads = [p.grad for p in params]

        def step() -> None:
            torch.stack([squared_norm(g) for g in grads]).sum().item()
            torch._foreach_mul_(grads, 0.5)
            opt.step()

        return _seconds(step) / n


def clear() -> None:
    """Forget measured times (a fresh calibration measures them again)."""
    global _memo
    _memo = {}
    _save(merge=False)
