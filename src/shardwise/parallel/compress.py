"""Gradient compression for the data-parallel all-reduce (`parallel.grad_compression`).

The gradient buffers stay fp32 (accumulation over micro-batches is exact as without
compression); only what crosses the wire is smaller:

* `bf16` / `fp16`: each bucket is cast to the 16-bit type for its all-reduce and the sum
  cast back: half the bytes, one rounding per step (fp16: range to 65504, like PyTorch
  DDP's fp16/bf16 compression hooks).
* `powersgd`: rank-r PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization", Algorithm 1 with error feedback, the algorithm
  of PyTorch DDP's `powerSGD_hook`). Per bucket, every gradient matrix M (m x n after
  flattening trailing dimensions) that compresses at least 2x (r·(m+n)·2 <= m·n) adds its
  error memory E, then P = M Q is all-reduced together with the bucket's uncompressed
  tensors (vectors, small matrices); P is orthonormalised, Q = Mᵀ P all-reduced, and the
  gradient becomes P Qᵀ. Bytes on the wire: r·(m+n) per compressed matrix plus every
  uncompressed element, fp32. Each rank keeps E = M - P Qᵀ / n_dp (its share of what the
  low-rank sum missed), and Q is reused as the next step's start (warm start) unless
  `parallel.powersgd_warm_start` is off. The error memory, Q and the random stream are
  per-rank state: a checkpoint keeps them under keys naming the rank (`per_rank_state`), and a
  run resumed in the same layout restores them, so it continues bit for bit; in another
  layout they restart (zero error, fresh Q), as DDP's hook does unless saved by hand.

The loss is normalised by the global token count, so the reduction is a sum (no division),
as in `parallel/data.py`.
"""

from __future__ import annotations

import torch

from shardwise.distributed.comm import Comm

WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}
MIN_RATE = 2  # compress a matrix only when its bytes shrink at least this much (DDP's default)


def compressed_shape(shape: tuple[int, ...], rank: int) -> tuple[int, int] | None:
    """(m, n) of a gradient that PowerSGD compresses at `rank`, None if it is sent whole."""
    if len(shape) < 2:
        return None
    m = shape[0]
    n = 1
    for s in shape[1:]:
        n *= s
    return (m, n) if rank * (m + n) * MIN_RATE <= m * n else None


def wire_elements(shapes: list[tuple[int, ...]], rank: int) -> int:
    """Elements PowerSGD all-reduces per step for gradients of these shapes."""
    total = 0
    for shape in shapes:
        mn = compressed_shape(shape, rank)
        if mn is None:
            total += int(torch.Size(shape).numel())
        else:
            total += rank * (mn[0] + mn[1])
    return total


class CastCompression:
    """A 16-bit copy of the bucket on the wire, summed back into the fp32 buffer."""

    def __init__(self, kind: str) -> None:
        self.dtype = WIRE[kind]
        self._wire: dict[int, torch.Tensor] = {}
        self.state_bytes = 0  # the most bytes of 16-bit copies in flight at once

    def launch(self, comm: Comm, index: int, buffer: torch.Tensor, params) -> object:
        wire = buffer.to(self.dtype)
        self._wire[index] = wire
        in_flight = sum(w.numel() * w.element_size() for w in self._wire.values())
        self.state_bytes = max(self.state_bytes, in_flight)
        return comm.all_reduce(wire, "dp", async_op=True)

    def finish(self, comm: Comm, waits: list) -> None:
        for index, buffer, handle in waits:
            handle.wait()
            buffer.copy_(self._wire.pop(index))


class _Matrices:
    """One bucket's PowerSGD state: which gradients are compressed and their P, Q, error."""

    def __init__(self, params, rank: int, generator: torch.Generator) -> None:
        self.big, self.small = [], []
        for p in params:
            mn = compressed_shape(tuple(p.shape), rank)
            (self.small if mn is None else self.big).append((p, mn))
        device = params[0].device
        self.error = [torch.zeros(mn, device=device) for _, mn in self.big]
        self.q = [_random(mn[1], rank, generator, device) for _, mn in self.big]
        n_p = sum(mn[0] * rank for _, mn in self.big)
        n_small = sum(p.numel() for p, _ in self.small)
        self.first = torch.zeros(n_p + n_small, device=device)  # Ps, then the small tensors
        self.second = torch.zeros(sum(mn[1] * rank for _, mn in self.big), device=device)
        self.n_p = n_p
        self.handle = None

    def views(self, flat: torch.Tensor, rows: bool) -> list[torch.Tensor]:
        out, offset = [], 0
        for q, (_, mn) in zip(self.q, self.big, strict=True):
            k = (mn[0] if rows else mn[1]) * q.shape[1]
            out.append(flat[offset : offset + k].view(-1, q.shape[1]))
            offset += k
        return out


def _random(n: int, rank: int, generator: torch.Generator, device) -> torch.Tensor:
    return torch.randn(n, rank, generator=generator).to(device)


class PowerSGD:
    """Rank-`rank` PowerSGD with error feedback over the buckets of a `GradReducer`."""

    def __init__(self, rank: int, warm_start: bool, seed: int) -> None:
        self.rank = rank
        self.warm_start = warm_start
        # the same stream on every rank: the Q matrices must agree across the dp group
        self.generator = torch.Generator().manual_seed(seed)
        self._state: dict[int, _Matrices] = {}

    @property
    def state_bytes(self) -> int:
        """Error memory, warm-start Q and the two all-reduce buffers of every bucket."""
        total = 0
        for st in self._state.values():
            for t in [*st.error, *st.q, st.first, st.second]:
                total += t.numel() * t.element_size()
        return total

    def per_rank_state(self, buckets) -> list[tuple[str, torch.nn.Parameter, torch.Tensor]]:
        """What the next step depends on besides the model: (kind, parameter, tensor) for each
        compressed matrix's error memory ("error") and warm-start Q ("q"), bucket by bucket.
        Before the first step they are made now, with the draws that step would make."""
        out = []
        for index, bucket in enumerate(buckets):
            st = self._matrices(index, bucket.params)
            for (p, _), err, q in zip(st.big, st.error, st.q, strict=True):
                out += [("error", p, err), ("q", p, q)]
        return out

    def _matrices(self, index: int, params) -> _Matrices:
        if index not in self._state:
            self._state[index] = _Matrices(params, self.rank, self.generator)
        return self._state[index]

    def launch(self, comm: Comm, index: int, buffer: torch.Tensor, params) -> object:
        st = self._matrices(index, params)
        ps = st.views(st.first, rows=True)
        for (p, mn), err, q, out in zip(st.big, st.error, st.q, ps, strict=True):
            m = p.main_grad.view(mn)
            m.add_(err)
            if not self.warm_start:
                q.copy_(_random(mn[1], self.rank, self.generator, q.device))
            torch.matmul(m, q, out=out)
        offset = st.n_p
        for p, _ in st.small:
            st.first[offset : offset + p.numel()].copy_(p.main_grad.reshape(-1))
            offset += p.numel()
        return comm.all_reduce(st.first, "dp", async_op=True)

    def finish(self, comm: Comm, waits: list) -> None:
        second = []
        for index, _, handle in waits:
            st = self._state[index]
            handle.wait()
            offset = st.n_p
            for p, _ in st.small:
                p.main_grad.view(-1).copy_(st.first[offset : offset + p.numel()])
                offset += p.numel()
            if not st.big:
                continue
            qs = st.views(st.second, rows=False)
            for (p, mn), pm, out in zip(st.big, st.views(st.first, rows=True), qs, strict=True):
                pm.copy_(torch.linalg.qr(pm).Q)  # the same P on every rank after the sum
                torch.matmul(p.main_grad.view(mn).t(), pm, out=out)
            second.append((st, comm.all_reduce(st.second, "dp", async_op=True)))
        n = comm.topo.size("dp")
        for st, handle in second:
            handle.wait()
            ps, qs = st.views(st.first, rows=True), st.views(st.second, rows=False)
            for (p, mn), err, q, pm, qm in zip(st.big, st.error, st.q, ps, qs, strict=True):
                m = p.main_grad.view(mn)
                approx = pm @ qm.t()  # ~ the sum over ranks of (gradient + error)
                torch.sub(m, approx, alpha=1.0 / n, out=err)
                m.copy_(approx)
                q.copy_(qm)
                # a non-finite gradient's step is skipped (training/loop.py): it must not
                # poison the steps after it through the error memory or the warm start
                torch.nan_to_num(err, nan=0.0, posinf=0.0, neginf=0.0, out=err)
                torch.nan_to_num(q, nan=0.0, posinf=0.0, neginf=0.0, out=q)


def make_compression(kind: str, rank: int, warm_start: bool, seed: int):
    """The compression object for `parallel.grad_compression`, None for `none`."""
    if kind == "none":
        return None
    if kind == "powersgd":
        return PowerSGD(rank, warm_start, seed)
    return CastCompression(kind)
