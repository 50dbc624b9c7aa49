"""ZeRO-3's gather and free of whole units, half of parallel/zero.py's engine.

A unit is all-gathered by a forward pre-hook on its root module(s), the next unit prefetched,
and freed after its forward; it is gathered again when the first gradient of its outputs
arrives (the unit before it prefetched) and freed once its gradients are reduce-scattered.
The bytes of gathered units and in-flight gradient buffers are counted here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from shardwise.distributed.comm import Comm
from shardwise.errors import ShardwiseError
from shardwise.parallel.zero_units import Unit


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(output) -> list[torch.Tensor]:
    """Every tensor in a module's output: a tensor, or one nested in tuples, lists,
    mappings (a transformers `ModelOutput` is an OrderedDict) and dataclasses."""
    if isinstance(output, torch.Tensor):
        return [output]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        output = [getattr(output, f.name) for f in dataclasses.fields(output)]
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


class ZeroGather:
    """The gather/free methods of ZeroEngine (parallel/zero.py), which sets these attributes."""

    comm: Comm
    stage: int
    units: list[Unit]
    transient: int  # bytes of gathered units and in-flight gradient buffers now, and their peak
    peak_transient: int
    gathered_bytes: int  # bytes of gathered ZeRO-3 units now, and their peak
    peak_gathered: int

    def _hook_modules(self, model: nn.Module) -> None:
        # The backward gather hangs on the gradient of the module's output tensors, not on a
        # module full-backward pre-hook: torch never calls the latter for an output that is
        # not a tensor or a tuple of them (a transformers `ModelOutput`, a dict), and a unit
        # left un-gathered there ran its backward on an unwaited prefetch and its next
        # forward on the values from before the optimizer step. (FSDP hooks the outputs too.)
        for unit in self.units:
            for module in unit.modules:
                module.register_forward_pre_hook(lambda m, a, u=unit: self._before(u, 1))
                module.register_forward_hook(lambda m, a, o, u=unit: self._after_forward(u, o))

    # -- ZeRO-3 gather / free -------------------------------------------------------------------
    def _gather(self, unit: Unit, async_op: bool) -> None:
        if unit.gathered or unit.handle is not None:
            return
        unit.allocate()
        unit.staging = unit.shard.to(unit.full.device, non_blocking=True)  # host -> device
        self._grow(unit.full_bytes)
        self.gathered_bytes += unit.full_bytes
        self.peak_gathered = max(self.peak_gathered, self.gathered_bytes)
        unit.handle = self.comm.all_gather(unit.full, unit.staging, unit.dim, async_op=async_op)

    def _ensure(self, unit: Unit) -> None:
        self._gather(unit, async_op=False)
        if unit.handle is not None:
            unit.handle.wait()
            unit.handle = None
        unit.staging = None
        unit.gathered = True

    def _free(self, unit: Unit) -> None:
        if self.stage == 3 and unit.gathered:
            unit.release()
            self._grow(-unit.full_bytes)
            self.gathered_bytes -= unit.full_bytes

    def _before(self, unit: Unit, direction: int) -> None:
        """Gather `unit` before its forward (+1) or backward (-1) and prefetch the next one
        in that direction (units are registered in forward order)."""
        try:
            self._gather_for(unit, direction)
        except RuntimeError as exc:  # a timed-out or mismatched collective
            raise self._diverged(
                unit, "before its " + ("forward" if direction > 0 else "backward"), exc
            ) from None

    def _diverged(self, unit: Unit, when: str, exc: Exception) -> ShardwiseError:
        return ShardwiseError(
            f"ZeRO-3: the all-gather of unit '{unit.name}' {when} failed on dp rank "
            f"{self.comm.topo.coord('dp')} ({str(exc).splitlines()[0][:160]}). Another rank "
            "stopped or ran different units: ZeRO-3 gathers every unit collectively, so the "
            "forward must call the same modules on every rank. Fix: make the control flow "
            "independent of the rank's data, or use --parallel.zero=2."
        )

    def _gather_for(self, unit: Unit, direction: int) -> None:
        if direction > 0 and not _in_backward():
            unit.forward_calls += 1
        if direction < 0:  # backward has left the roots after this one: their frozen units go
            for done in self.units:  # (a trainable unit is freed once its gradients are reduced)
                if done.n_trainable == 0 and done.root > unit.root:
                    self._free(done)
        self._ensure(unit)
        if direction > 0 and unit.forward_calls > 1:
            # a second use in this forward (a tied head): the next unit already ran, and
            # gathering it now would hold its parameters through the whole backward
            return
        i = self.units.index(unit) + direction
        if 0 <= i < len(self.units) and not (direction < 0 and self.units[i].done):
            self._gather(self.units[i], async_op=True)

    def _after_forward(self, unit: Unit, output) -> None:
        found = _tensors(output)
        needs_grad = [t for t in found if t.requires_grad]
        if needs_grad:  # the first output gradient computed: this unit's backward is next
            register_multi_grad_hook(needs_grad, lambda g, u=unit: self._before(u, -1), mode="any")
        elif not found and output is not None and unit.n_trainable and torch.is_grad_enabled():
            # its backward would run on freed parameters: stop with the reason instead
            raise ShardwiseError(
                f"ZeRO-3: unit '{unit.name}' returned a {type(output).__name__}, in which no "
                "tensor was found to gather its parameters for backward on (ZeRO-3 looks into "
                "tensors, tuples, lists, mappings and dataclasses). Fix: return one of those "
                "from that module, or --parallel.zero=2."
            )
        if not _in_backward():  # a recomputation inside backward still needs it
            self._free(unit)

    def _grow(self, nbytes: int) -> None:
        self.transient += nbytes
        self.peak_transient = max(self.peak_transient, self.transient)
