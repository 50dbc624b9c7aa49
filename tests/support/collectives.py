"""Byte counting at `torch.distributed` for the peers: every collective a peer (FSDP2,
DeepSpeed, DTensor, torch pipelining) calls is counted with the ring-equivalent conventions of
docs/design.md, so its traffic compares with our Comm's counters key by key."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# name -> (argument holding the full-size tensor(s), ring factor as a function of n), the
# conventions of docs/design.md: all-reduce 2(n-1)/n·S, reduce-scatter/all-gather (n-1)/n·S of the
# full tensor, broadcast (n-1)/n·S.
_COLLECTIVES: dict[str, tuple[str, Callable[[int], float]]] = {
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
    "all_reduce_coalesced": ("tensors", lambda n: 2 * (n - 1) / n),
    "reduce_scatter_single": ("input", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("input", lambda n: (n - 1) / n),
    "_reduce_scatter_base": ("input", lambda n: (n - 1) / n),
    "reduce_scatter": ("input_list", lambda n: (n - 1) / n),
    "all_gather_single": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("output_tensor", lambda n: (n - 1) / n),
    "_all_gather_base": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather": ("tensor_list", lambda n: (n - 1) / n),
    "broadcast": ("tensor", lambda n: (n - 1) / n),
}


@dataclass
class CollectiveCounter:
    """Ring-equivalent bytes sent by this rank while `active`, by collective name. Tensors of
    one element (loss, norm and overflow scalars) are control traffic, counted apart."""

    active: bool = False
    bytes: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    control_bytes: float = 0.0
    _depth: int = 0  # a deprecated alias calls its successor: count the outer call only

    @property
    def total(self) -> float:
        return sum(self.bytes.values())


def _counting(name: str, fn: Callable, counter: CollectiveCounter) -> Callable:
    arg, factor = _COLLECTIVES[name]
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if counter.active and counter._depth == 0:
            bound = signature.bind_partial(*args, **kwargs).arguments
            tensors = bound.get(arg)
            tensors = [tensors] if torch.is_tensor(tensors) else list(tensors or [])
            numel = sum(t.numel() for t in tensors)
            sent = factor(dist.get_world_size(bound.get("group"))) * sum(
                t.numel() * t.element_size() for t in tensors
            )
            if numel <= 1:
                counter.control_bytes += sent
            else:
                counter.bytes[name] = counter.bytes.get(name, 0.0) + sent
                counter.calls[name] = counter.calls.get(name, 0) + 1
        counter._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counter._depth -= 1

    wrapper.__wrapped_collective__ = fn
    return wrapper


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Wrap torch.distributed's collectives (and the ones DeepSpeed's backend captured when
    it initialised) with byte counters; everything is restored on exit. The wrappers cost a
    signature bind per call while counting, microseconds against steps of 10-100 ms."""
    from torch.distributed import distributed_c10d as c10d

    counter = CollectiveCounter()
    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, attr: str, name: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is not None and not hasattr(fn, "__wrapped_collective__"):
            saved.append((owner, attr, fn))
            setattr(owner, attr, _counting(name, fn, counter))

    for name in _COLLECTIVES:
        patch(dist, name, name)
        patch(c10d, name, name)
    try:
        yield counter
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)
        _restore_deepspeed_backend()


def patch_deepspeed_backend() -> None:
    """DeepSpeed's torch backend keeps the flat gather/scatter functions it found at start-up:
    point them at the (counting) module functions."""
    backend = _deepspeed_backend()
    if backend is not None:
        backend.all_gather_function = dist.all_gather_into_tensor
        backend.reduce_scatter_function = dist.reduce_scatter_tensor


def _restore_deepspeed_backend() -> None:
    backend = _deepspeed_backend()
    if backend is None:
        return
    for attr in ("all_gather_function", "reduce_scatter_function"):
        fn = getattr(backend, attr, None)
        if hasattr(fn, "__wrapped_collective__"):
            setattr(backend, attr, fn.__wrapped_collective__)


def _deepspeed_backend():
    comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(comm, "cdb", None) if comm is not None else None
