"""Exact per-rank memory by category, counted from the engine's own tensors.

Model states are summed from the tensors that hold them. Activations are the bytes saved for
backward, seen through `torch.autograd.graph.saved_tensors_hooks` and de-duplicated by storage
(a tensor saved by two ops, or two views of one storage, count once; parameters saved by the
ops that use them are not activations). Backward only frees saved tensors, so the peak within
a micro-batch is reached when its forward ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from shardwise.finetune.quant import quant_layers, quantised_bytes


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _held(storage: torch.UntypedStorage) -> StorageWeakRef:
    """A weak reference to a tensor's storage. The meter keys storages by their object's address;
    the weak reference keeps that object (not its data) allocated while the meter holds it, so
    a storage freed during a forward cannot pass its address to a later one. Saved tensors are
    freed before the forward ends where a branch's graph is dropped (a router's top-k scores
    of which only the indices are kept): a later storage at the same address would count as
    already seen, and the sum would depend on how the allocator reuses addresses."""
    return StorageWeakRef(storage)


class ActivationMeter:
    """Counts bytes saved for backward during forward passes run inside `measure()`."""

    def __init__(self, model: nn.Module) -> None:
        held = (p.untyped_storage() for p in model.parameters())
        self._exclude = {s._cdata: _held(s) for s in held}
        self._seen: dict[int, StorageWeakRef] = {}
        self.current = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()  # (once: a call for every tensor saved in a forward)
        key = storage._cdata
        if key not in self._exclude and key not in self._seen:
            self._seen[key] = _held(storage)
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        return t

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Wrap one micro-batch's forward. Its saved bytes start from zero: the previous
        micro-batch's backward has already released everything it saved."""
        self._seen.clear()
        self.current = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    def take_peak(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


def model_state_bytes(model: nn.Module, reducer, optimizer) -> dict[str, int]:
    """Bytes of the persistent categories on this rank."""
    layers = [m for _, m in quant_layers(model)]
    quantised = {id(t) for m in layers for t in m.buffers()}
    buffers = [b for b in model.buffers() if id(b) not in quantised]  # those are parameters
    states = {
        # local copies or shards (a tied weight once), and a quantised frozen base
        "params": reducer.param_bytes + quantised_bytes(layers),
        "grads": reducer.grad_bytes,
        "master": optimizer.master_bytes,
        "optimizer": optimizer.state_bytes,
        # module buffers plus the peak of gathered ZeRO-3 units and in-flight gradient
        # buffers, and of one quantised weight gathered and dequantised
        "buffers": tensor_bytes(buffers)
        + reducer.peak_transient
        + max((m.peak_transient for m in layers), default=0),
    }
    if getattr(optimizer, "offload", False):  # host memory is a budget of its own
        states["host_master"] = states.pop("master")
        states["host_optimizer"] = states.pop("optimizer")
        states["master"] = states["optimizer"] = 0
    if getattr(optimizer, "disk_bytes", 0):  # optimizer+nvme: on disk, beside the others
        states["disk_optimizer"] = optimizer.disk_bytes
    if getattr(reducer, "host_param_bytes", 0):
        states["host_params"] = reducer.host_param_bytes
        states["params"] -= reducer.host_param_bytes
    if getattr(reducer, "disk_param_bytes", 0):  # params+nvme: in files, mapped
        states["disk_params"] = reducer.disk_param_bytes
        states["params"] -= reducer.disk_param_bytes
    return states


def step_memory(states: dict[str, int], activations: int) -> dict[str, int]:
    """All categories plus `total` (device memory only): persistent states are resident for
    the whole step, so the peak of the sum is states + the activation peak. Offloaded
    `host_*` (and `disk_*`) categories are reported beside it, not in it."""
    out = dict(states)
    out["activations"] = activations
    out["total"] = (
        sum(v for k, v in states.items() if not k.startswith(("host_", "disk_"))) + activations
    )
    return out
