"""Data parallelism: bucketed gradient all-reduce overlapped with backward.

Each parameter's gradient lives in a view (`param.main_grad`) of a flat bucket buffer in the
reduce dtype. A post-accumulate-grad hook adds the fresh gradient into that view and frees
`param.grad`; when every parameter of a bucket has reported on the micro-batch that syncs,
the bucket's all-reduce is launched asynchronously while autograd keeps computing earlier
layers. Buckets are launched strictly in index order so every rank issues the same sequence
of collectives (a rank's readiness order could otherwise differ and deadlock). The loss is
already normalised by the *global* token count, so the sum over ranks is the gradient of the
global loss: no division after the reduce. `compression` (parallel/compress.py) changes
what crosses the wire, not the buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.distributed.comm import Comm


@dataclass
class Bucket:
    buffer: torch.Tensor
    params: list[nn.Parameter]
    pending: int = 0
    handle: object | None = None
    reported: set[int] = field(default_factory=set)
    dim: str = "dp"  # "edp": expert parallelism's experts, reduced over their holders only


class GradReducer:
    """Owns the gradient buffers of a model and reduces them over the `dp` dimension."""

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        reduce_dtype: torch.dtype,
        bucket_bytes: int,
        compression=None,
    ) -> None:
        self.comm = comm
        self.compression = compression if comm.topo.size("dp") > 1 else None
        self.sync = True  # the one visible flag: False on accumulation micro-batches
        params = [p for p in model.parameters() if p.requires_grad]
        self._params = list(model.parameters())
        # Reverse registration order approximates the order backward produces gradients.
        # Expert slices (parallel/expert.py) are reduced over their holders only ("edp"):
        # buckets of their own, after the dense ones (one group per bucket).
        order = list(reversed(params))
        dense = [p for p in order if getattr(p, "reduce_dim", "dp") == "dp"]
        experts = [p for p in order if getattr(p, "reduce_dim", "dp") != "dp"]
        self.buckets = _make_buckets(dense, reduce_dtype, bucket_bytes)
        self.buckets += _make_buckets(experts, reduce_dtype, bucket_bytes, "edp")
        self._of: dict[int, Bucket] = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._next = 0

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._params)

    @property
    def peak_transient(self) -> int:
        """No gathered units; a compressed wire's buffers and state (parallel/compress.py)."""
        return self.compression.state_bytes if self.compression is not None else 0

    @property
    def grad_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
        self.start_micro_batch()

    def start_micro_batch(self) -> None:
        for b in self.buckets:
            b.reported.clear()
            b.pending = len(b.params)
            b.handle = None
        self._next = 0

    def _on_grad(self, p: nn.Parameter) -> None:
        p.main_grad.add_(p.grad)  # casts to the reduce dtype
        p.grad = None
        bucket = self._of[id(p)]
        if id(p) in bucket.reported:  # a second backward through the same leaf (recompute)
            return
        bucket.reported.add(id(p))
        bucket.pending -= 1
        if self.sync and bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            b = self.buckets[self._next]
            if self.compression is None:
                b.handle = self.comm.all_reduce(b.buffer, b.dim, async_op=True)
            else:
                b.handle = self.compression.launch(self.comm, self._next, b.buffer, b.params)
            self._next += 1

    def finish(self) -> None:
        """After a micro-batch's backward; on the syncing one, reduce what never filled
        (parameters unused this step keep a zero gradient) and wait for every bucket."""
        if not self.sync:
            return
        for b in self.buckets[self._next :]:
            b.pending = 0
        self._launch_ready()
        if self.compression is not None:
            waits = [(i, b.buffer, b.handle) for i, b in enumerate(self.buckets)]
            self.compression.finish(self.comm, [w for w in waits if w[2] is not None])
            for b in self.buckets:
                b.handle = None
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None


def _make_buckets(
    params: list[nn.Parameter], dtype: torch.dtype, cap: int, dim: str = "dp"
) -> list[Bucket]:
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * torch.tensor([], dtype=dtype).element_size()
        if groups[-1] and size + nbytes > cap:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    buckets = []
    for group in groups:
        if not group:  # nothing trainable here (a frozen pipeline stage): no bucket
            continue
        buffer = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
        offset = 0
        for p in group:
            p.main_grad = buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        buckets.append(Bucket(buffer, group, pending=len(group), dim=dim))
    return buckets


def apply_data_parallel(
    model: nn.Module,
    comm: Comm,
    reduce_dtype: torch.dtype,
    bucket_mb: float,
    compression=None,
) -> GradReducer:
    """Attach bucketed, overlapped gradient reduction over `dp` to a materialised model."""
    return GradReducer(model, comm, reduce_dtype, int(bucket_mb * 1024 * 1024), compression)


def sync_buffers(model: nn.Module, comm: Comm) -> None:
    """Average floating-point persistent buffers (BatchNorm running stats) over dp so every
    replica evaluates identically; DDP instead broadcasts rank 0's, discarding the others."""
    n = comm.topo.size("dp")
    if n == 1:
        return
    for module in model.modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        for name in ("running_mean", "running_var"):
            buf = getattr(module, name, None)
            if buf is not None:
                comm.all_reduce(buf, "dp", control=True)
                buf.div_(n)
