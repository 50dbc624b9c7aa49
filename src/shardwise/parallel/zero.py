"""ZeRO stages 1-3 (Rajbhandari et al. 2020) on one mechanism: flat, padded, evenly split units.

Parameters are grouped into units: one per repeated block (transformer block, ResNet stage) and
one per other top-level child that owns parameters (embedding, final norm, head, ...). A unit
owns a flat buffer in the compute dtype, padded to a multiple of the dp degree; rank r owns
slice r. Every parameter is an alias of its place in that buffer (with its own autograd
version counter, so refilling the buffer between forward and backward is legal).

* ZeRO-1: full parameters and full gradient buffers stay; on the syncing micro-batch each
  unit's gradients are reduce-scattered (not all-reduced); the fp32 master and optimizer state
  exist for the local slice only; the updated slices are all-gathered after the step.
* ZeRO-2: as 1, but each unit's gradients are reduce-scattered as soon as its backward ends,
  on every micro-batch, into a gradient shard; full gradients live only transiently.
* ZeRO-3: as 2, and the parameters themselves are sharded: a unit is all-gathered just before
  its forward (the next unit prefetched), freed after it, gathered again before its backward
  and freed once its gradients are reduce-scattered.

Traffic per step without accumulation, Ψ parameters over n ranks: ZeRO-1/2 send
(n-1)/n·Ψ (reduce-scatter) + (n-1)/n·Ψ (all-gather) = DDP; ZeRO-3 adds a second all-gather.
With accumulation ZeRO-1 reduces once per step, ZeRO-2/3 once per micro-batch (and ZeRO-3
gathers twice per micro-batch).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.distributed.comm import Comm
from shardwise.errors import ShardwiseError
from shardwise.models.init import (
    canonical_name,
    find_spec,
    initial_local,
    restore_buffers,
    take_buffers,
)
from shardwise.optim import Target
from shardwise.parallel.zero_gather import ZeroGather
from shardwise.parallel.zero_units import Sharding, Unit, unit_roots


class ZeroEngine(ZeroGather):
    """Owns the units of one model; the training loop drives it like the DP reducer (ZeRO-3's
    gather and free: parallel/zero_gather.py)."""

    def __init__(self, model: nn.Module, comm: Comm, how: Sharding, seed: int, source=None) -> None:
        self.comm, self.stage = comm, how.stage
        # the disk store of ZeRO-3's slices with params+nvme (closed with the engine)
        self.store = None if isinstance(how.offload_params, bool) else how.offload_params
        self.wire = how.wire if comm.topo.size("dp") > 1 else None
        self.sync = True
        # Trainable and frozen parameters of a root never share a unit: a frozen unit has no
        # gradient buffers and nothing to reduce (LoRA keeps its few trainable parameters in
        # small units of their own, so the saving is not lost to a shared flat buffer).
        # Expert parameters (parallel/expert.py) sit in units of their own, sharded and reduced
        # over the ranks holding the same experts ("edp") instead of the whole dp line.
        self.units = []
        for root, (name, entries, modules) in enumerate(unit_roots(model)):
            for part, group in _by_trainability(name, entries):
                for sub, members, dim in _by_reduce_dim(part, group):
                    n, rank = comm.topo.size(dim), comm.topo.coord(dim)
                    unit = Unit(sub, members, modules, n, rank, how)
                    unit.root, unit.dim = root, dim  # its root's place in forward order
                    self.units.append(unit)
        replaced = {k: v for u in self.units for k, v in u.replaced.items()}
        for module in model.modules():  # every use of an old parameter, tied ones included
            for leaf, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[leaf] = replaced[id(p)]
        self._of_param = {id(p): u for u in self.units for *_, p in u.entries}
        self._materialise(model, seed, how.device, source)
        self._next = 0
        self._pending: list = []
        self.transient = 0  # bytes of gathered units and in-flight gradient buffers now
        self.peak_transient = 0
        self.gathered_bytes = 0  # bytes of gathered ZeRO-3 units now, and their peak
        self.peak_gathered = 0
        for unit in self.units:
            for p in unit.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._on_grad)
        if how.stage == 3:
            self._hook_modules(model)
            self.transient = sum(u.full_bytes for u in self.units)  # built gathered
            self.gathered_bytes = self.transient
            for unit in self.units:
                self._free(unit)
        self.peak_transient = 0

    # -- set-up -------------------------------------------------------------------------------
    @torch.no_grad()
    def _materialise(self, model: nn.Module, seed: int, device: torch.device, source) -> None:
        """Each rank fills only what it keeps: the full unit (ZeRO-1/2) or its own slice
        (ZeRO-3), from the (seed, name) init, one parameter's value at a time, or from a
        weight `source` (Hugging Face safetensors) that reads only the kept elements."""
        spec = find_spec(model)
        for unit in self.units:
            for (name, module, leaf, p), off in zip(unit.entries, unit.offsets, strict=False):
                cname = canonical_name(name, spec)
                if source is None or not source.has(cname):  # (a new head: from seed)
                    unit.load(off, initial_local(module, leaf, cname, p, seed, spec).flatten())
                    continue
                start, stop = unit.kept(off, p.numel())
                if start < stop:
                    unit.load(off, source.span_of(cname, p, start, stop), start)
        take_buffers(model, source)  # persistent ones a checkpoint holds: whole on every rank
        if source is not None:
            source.close()
        for module in model.modules():  # buffers (BatchNorm statistics) are replicated
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    module._buffers[key] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.reset_running_stats()
        restore_buffers(model)

    # -- gradients ------------------------------------------------------------------------------
    @property
    def grad_bytes(self) -> int:
        return sum(u.grad_bytes for u in self.units)

    @property
    def param_bytes(self) -> int:
        return sum(u.param_bytes for u in self.units)

    @property
    def host_param_bytes(self) -> int:
        return sum(u.param_bytes for u in self.units if u.host_shard)

    @property
    def disk_param_bytes(self) -> int:
        return sum(u.param_bytes for u in self.units if u.on_disk)

    def close(self) -> None:
        """Remove the parameter slices' files (params+nvme)."""
        if self.store is not None:
            self.store.close()

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.zero_grad()
        self.peak_transient = self.transient
        self.peak_gathered = self.gathered_bytes
        self.start_micro_batch()

    def start_micro_batch(self) -> None:
        for unit in self.units:
            unit.reported.clear()
            unit.done = False
            unit.forward_calls = 0
        self._next = 0

    def _on_grad(self, p: nn.Parameter) -> None:
        unit = self._of_param[id(p)]
        if id(p) in unit.reported:
            return
        unit.add_grad(p)
        p.grad = None
        unit.reported.add(id(p))
        if len(unit.reported) == unit.n_trainable and (self.stage >= 2 or self.sync):
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Reduce units strictly in backward order so every rank issues the same sequence."""
        order = self.units[::-1]
        while self._next < len(order):
            unit = order[self._next]
            if not force and len(unit.reported) < unit.n_trainable:
                return
            if unit.n_trainable == 0:  # a frozen unit: nothing to reduce
                self._next += 1
                continue
            flat = unit.grad_to_reduce()
            if flat is not unit.grad_full:
                self._grow(flat.numel() * flat.element_size())
            send = flat
            if self.wire is not None:
                send = flat.to(self.wire)
                self._grow(send.numel() * send.element_size())
            # in place: the owned slice of the summed buffer lands where it already lives
            handle = self.comm.reduce_scatter(
                send[unit.lo : unit.hi], send, unit.dim, async_op=True
            )
            self._pending.append((unit, flat, send, handle))
            while len(self._pending) > 2:  # overlap with backward, bounded to two buffers
                self._complete()
            unit.done = True
            if self.stage == 3:
                self._free(unit)  # the reduce-scatter reads gradients, not parameters
            self._next += 1

    def _complete(self) -> None:
        unit, flat, send, handle = self._pending.pop(0)
        handle.wait()
        if send is not flat:
            flat[unit.lo : unit.hi].copy_(send[unit.lo : unit.hi])
            self._grow(-send.numel() * send.element_size())
        unit.take_reduced(flat)
        if flat is not unit.grad_full:
            self._grow(-flat.numel() * flat.element_size())

    def finish(self) -> None:
        """End of a micro-batch's backward. ZeRO-2/3 (every micro-batch) and ZeRO-1 (the
        syncing one) reduce units some of whose parameters got no gradient (they count as
        zero); anything still gathered is freed."""
        if self.stage == 3:
            try:
                self._check_same_units()
            except RuntimeError as exc:
                raise ShardwiseError(
                    f"ZeRO-3: the per-unit consistency check failed on dp rank "
                    f"{self.comm.topo.coord('dp')} ({str(exc).splitlines()[0][:160]}): another "
                    "rank stopped or ran different units. Fix: make the control flow independent "
                    "of the rank's data, or use --parallel.zero=2."
                ) from None
        if self.stage >= 2 or self.sync:
            self._launch_ready(force=True)
            while self._pending:
                self._complete()
        for unit in self.units:
            self._settle(unit)

    def _settle(self, unit: Unit) -> None:
        """Free `unit` at the end of a backward, a gather prefetched for a backward that never
        came (its outputs got no gradient) included: a trainable unit's copy would outlive
        the optimizer step and feed the next forward stale values. A frozen unit's cannot
        change, so it stays for the next forward (the traffic it saves is the prefetch's)."""
        if unit.handle is not None:
            self._ensure(unit)
            if unit.n_trainable == 0:
                return
        self._free(unit)

    def _check_same_units(self) -> None:
        """ZeRO-3 gathers units collectively, so every dp rank must run the same units. A
        rank whose forward skipped a unit would silently pair its collectives with another
        unit's; compare the per-unit forward counts (a few bytes of bookkeeping) instead."""
        counts = torch.tensor(
            [u.forward_calls for u in self.units],
            dtype=torch.float64,
            device=self.units[0].grad_shard.device,
        )
        hi, lo = counts.clone(), counts.clone()
        self.comm.all_reduce(hi, "dp", op="max", control=True)
        self.comm.all_reduce(lo, "dp", op="min", control=True)
        bad = [u for u, a, b in zip(self.units, hi.tolist(), lo.tolist(), strict=True) if a != b]
        if bad:
            mine = {u.name: u.forward_calls for u in bad}
            raise ShardwiseError(
                f"ZeRO-3: the ranks ran different units this micro-batch: unit(s) "
                f"{[u.name for u in bad]} ran {mine} time(s) on dp rank "
                f"{self.comm.topo.coord('dp')} but between {int(min(lo.tolist()))} and "
                f"{int(max(hi.tolist()))} times across the dp ranks. ZeRO-3 gathers every unit "
                "collectively, so the forward must call the same modules on every rank. Fix: "
                "make the control flow independent of the rank's data, or use "
                "--parallel.zero=2."
            )

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter at full shape on CPU, by its model name (collective: all dp ranks
        must call it). For tests and export; ZeRO-3 gathers one unit at a time."""
        out = {}
        for unit in self.units:
            was_gathered = unit.gathered
            self._ensure(unit)
            for name, _, _, p in unit.entries:
                out[name] = p.detach().float().cpu().clone()
            if not was_gathered:
                self._free(unit)
        return out

    # -- optimizer ------------------------------------------------------------------------------
    def targets(self) -> list[Target]:
        return [t for u in self.units for t in u.targets()]

    def sum_over_shards(self, norm_sq: torch.Tensor) -> None:  # [tp-sharded, other] parts
        """Each rank holds a disjoint gradient slice: the squared norms add up (bookkeeping)."""
        self.comm.all_reduce(norm_sq, "dp", control=True)

    @torch.no_grad()
    def after_step(self) -> None:
        if self.stage < 3:  # publish the updated slices to every replica (frozen: unchanged)
            for unit in self.units:
                if unit.n_trainable:
                    self.comm.all_gather(unit.full, unit.full[unit.lo : unit.hi], unit.dim)


def _by_trainability(name: str, entries: list) -> list[tuple[str, list]]:
    """A root's parameters as up to two units: the trainable ones, then the frozen ones."""
    trainable = [e for e in entries if e[3].requires_grad]
    frozen = [e for e in entries if not e[3].requires_grad]
    if not trainable or not frozen:
        return [(name, entries)]
    return [(name, trainable), (f"{name}[frozen]", frozen)]


def _by_reduce_dim(name: str, entries: list) -> list[tuple[str, list, str]]:
    """A unit's parameters by the dimension their gradients are reduced over: the dp line,
    then (expert parallelism's experts, `reduce_dim`) the ranks holding the same experts."""
    dims = [getattr(e[3], "reduce_dim", "dp") for e in entries]
    if len(set(dims)) == 1:
        return [(name, entries, dims[0])]
    dense = [e for e, d in zip(entries, dims, strict=True) if d == "dp"]
    experts = [e for e, d in zip(entries, dims, strict=True) if d != "dp"]
    return [(name, dense, "dp"), (f"{name}[experts]", experts, "edp")]


def apply_zero(model: nn.Module, comm: Comm, how: Sharding, seed: int, source=None) -> ZeroEngine:
    """Shard a model that is still on the meta device as `how` says; returns the engine
    driving it. `source` (shardwise.models.hf.weights.HFWeights) supplies the values instead
    of the (seed, name) init."""
    return ZeroEngine(model, comm, how, seed, source)
