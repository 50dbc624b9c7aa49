"""The unit of ZeRO sharding: a flat, padded, evenly split buffer of some parameters."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from shardwise.models.families import family_of
from shardwise.models.init import find_spec
from shardwise.optim import Target
from shardwise.parallel.tensor import keep_tp_marks


def _alias(storage: torch.UntypedStorage, offset: int, shape, dtype, device) -> torch.Tensor:
    """A tensor on `storage` with its own autograd version counter: writes through the unit
    buffer (a re-gather) must not look like in-place edits of a parameter saved for backward."""
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape)


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


Entry = tuple[str, nn.Module, str, nn.Parameter]  # (qualified name, owner, attribute, param)


def _top_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    roots: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or (
            name.startswith("layer") and isinstance(child, nn.Sequential)
        ):
            roots += [(f"{name}.{i}", block) for i, block in child.named_children()]
        elif any(True for _ in child.parameters()):
            roots.append((name, child))
    return roots


def _block_roots(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """A transformers model (model.name=hf, the hf-* presets: the family's `zero_units`): a
    root at each instance of its repeated block class (`_no_split_modules`, e.g.
    LlamaDecoderLayer, BertLayer) wherever it sits, and at every other maximal subtree owning
    parameters (embeddings, final norm, pooler, head)."""
    spec = find_spec(model)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    if spec is None or family_of(spec).zero_units != "blocks" or not blocks:
        return None

    def holds_block(module: nn.Module) -> bool:
        return any(type(m).__name__ in blocks for m in module.modules())

    def walk(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
        out = []
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if type(child).__name__ in blocks:
                out.append((path, child))
            elif holds_block(child):
                out += walk(f"{path}.", child)
            elif any(True for _ in child.parameters()):
                out.append((path, child))
        return out

    return walk("", model)


def unit_roots(model: nn.Module) -> list[tuple[str, list[Entry], list[nn.Module]]]:
    """Units in forward order: each block of a repeated container (`blocks`, also as a
    pipeline stage's `ModuleDict`, a ResNet `layerN`) and each other top-level child owning
    parameters. A tied parameter belongs to the first unit that reaches it; every root module
    using a unit's parameters is listed with it (a tied head needs the embedding's unit
    gathered)."""
    roots = _block_roots(model) or _top_roots(model)
    owner: dict[int, int] = {}
    units: list[tuple[str, list[Entry], list[nn.Module]]] = []
    for root_name, root in roots:
        entries = []
        for mod_name, module in root.named_modules():
            for leaf, p in module.named_parameters(recurse=False):
                if id(p) not in owner:
                    owner[id(p)] = len(units)
                    prefix = f"{root_name}.{mod_name}" if mod_name else root_name
                    entries.append((f"{prefix}.{leaf}", module, leaf, p))
        if entries:
            units.append((root_name, entries, []))
    for _, root in roots:
        for index in dict.fromkeys(owner[id(p)] for p in root.parameters()):
            units[index][2].append(root)
    if len(owner) != len({id(p) for p in model.parameters()}):
        raise ValueError("parameters registered directly on the model root cannot be sharded")
    return units


@dataclasses.dataclass(frozen=True)
class Sharding:
    """What every unit of one engine shares."""

    stage: int  # ZeRO-1, 2 or 3
    compute: torch.dtype  # the parameters' dtype
    reduce: torch.dtype  # the gradient buffers' dtype
    device: torch.device
    # False, True (host memory) or a store of disk-backed tensors (optim/nvme.DiskTensors,
    # params+nvme): where ZeRO-3's parameter slices live
    offload_params: object = False
    # > 1 for a block-wise 8-bit optimizer (optim.QUANT_BLOCK): every parameter starts and
    # every shard boundary falls on a multiple of it, so each rank's piece of a parameter is
    # made of whole quantisation blocks of the parameter (gaps are zeros)
    align: int = 1
    # parallel.grad_compression=bf16/fp16: each reduce-scatter sends a 16-bit copy of the
    # flat gradients and the owned slice of the sum is taken back into fp32 (None: as kept)
    wire: torch.dtype | None = None


class Unit:
    """Some parameters as one flat, padded buffer split evenly over `n` ranks."""

    def __init__(
        self,
        name: str,
        entries: list[Entry],
        modules: list[nn.Module],
        n: int,
        rank: int,
        how: Sharding,
    ) -> None:
        self.name, self.stage = name, how.stage
        self.on_disk = not isinstance(how.offload_params, bool)
        self.host_shard = bool(how.offload_params) and not self.on_disk
        self.modules = modules  # root modules whose forward/backward need this unit
        self._lay_out(entries, n, rank, how.align)
        self.full = torch.zeros(self.padded, dtype=how.compute, device=how.device)
        self.full_bytes = self.full.numel() * self.full.element_size()
        self.shard = self._make_shard(how)
        self._alias_parameters(entries, how)
        self.n_trainable = sum(p.requires_grad for p in self.params)
        self.reported: set[int] = set()
        self.done = False
        self.forward_calls = 0  # forward gathers this micro-batch (ZeRO-3 consistency check)
        self.gathered = True
        self.handle = None
        self.root = 0  # the root's place in forward order (set by the engine)
        self.aligned = how.align > 1
        self._make_grad_buffers(how.reduce, how.device)
        self.reduce_dtype = how.reduce

    # -- set-up ---------------------------------------------------------------------------------
    def _lay_out(self, entries: list[Entry], n: int, rank: int, align: int) -> None:
        """Each parameter's offset in the flat buffer, the padded size and this rank's slice."""
        self.offsets, numel = [], 0
        for *_, p in entries:
            self.offsets.append(numel)
            numel = _round_up(numel + p.numel(), align)
        self.shard_size = _round_up(-(-numel // n), align)
        self.padded = self.shard_size * n
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size

    def _make_shard(self, how: Sharding) -> torch.Tensor:
        """The rank's persistent slice: a view of the full buffer (ZeRO-1/2), or its own."""
        stage, compute, device, host_shard = how.stage, how.compute, how.device, how.offload_params
        if stage == 3 and self.on_disk:  # params+nvme: a file of its own, mapped
            shard = host_shard.empty(self.shard_size, compute)
            shard.zero_()
            return shard
        if stage == 3:  # the persistent slice; in host memory with optimizer+params offload
            where = torch.device("cpu") if host_shard else device
            return torch.zeros(
                self.shard_size,
                dtype=compute,
                device=where,
                pin_memory=host_shard and device.type == "cuda",
            )
        return self.full[self.lo : self.hi]

    def _alias_parameters(self, entries: list[Entry], how: Sharding) -> None:
        """New parameters aliasing the buffer; `replaced` maps old ids so the engine can re-point
        every use in the model (tied uses included)."""
        storage = self.full.untyped_storage()
        compute, device = how.compute, how.device
        self.replaced: dict[int, nn.Parameter] = {
            id(p): keep_tp_marks(
                p,
                nn.Parameter(
                    _alias(storage, off, p.shape, compute, device), requires_grad=p.requires_grad
                ),
            )
            for (*_, p), off in zip(entries, self.offsets, strict=True)
        }
        self.entries = [(n_, m, leaf, self.replaced[id(p)]) for n_, m, leaf, p in entries]
        self.params = [e[3] for e in self.entries]

    def _make_grad_buffers(self, reduce: torch.dtype, device: torch.device) -> None:
        """The gradient buffers the stage keeps (`main_grad` views into them for ZeRO-1)."""
        if self.n_trainable == 0:  # frozen: no gradient buffers at all
            self.grad_full = None
            self.grad_shard = torch.zeros(0, dtype=reduce, device=device)
        elif self.stage == 1:  # full gradients, reduce-scattered in place once per step
            self.grad_full = torch.zeros(self.padded, dtype=reduce, device=device)
            for p, off in zip(self.params, self.offsets, strict=True):
                p.main_grad = self.grad_full[off : off + p.numel()].view_as(p)
            self.grad_shard = self.grad_full[self.lo : self.hi]
        else:
            self.grad_full = None
            self.grad_shard = torch.zeros(self.shard_size, dtype=reduce, device=device)

    # -- values ---------------------------------------------------------------------------------
    def kept(self, offset: int, numel: int) -> tuple[int, int]:
        """The elements [start, stop) of the flat parameter at `offset` this rank stores
        (start >= stop: none)."""
        if self.stage < 3:
            return 0, numel
        return max(self.lo - offset, 0), min(self.hi - offset, numel)

    def load(self, offset: int, value: torch.Tensor, start: int = 0) -> None:
        """Write elements [start, start + len) of the flat parameter at `offset` (its full
        initial value by default), keeping only what this rank stores."""
        offset += start
        if self.stage < 3:
            self.full[offset : offset + value.numel()].copy_(value)
            return
        lo, hi = max(offset, self.lo), min(offset + value.numel(), self.hi)
        if lo < hi:
            self.shard[lo - self.lo : hi - self.lo].copy_(value[lo - offset : hi - offset])

    def allocate(self) -> None:
        self.full.untyped_storage().resize_(self.full_bytes)

    def release(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    @property
    def param_bytes(self) -> int:
        t = self.shard if self.stage == 3 else self.full
        return t.numel() * t.element_size()

    @property
    def grad_bytes(self) -> int:
        t = self.grad_shard if self.grad_full is None else self.grad_full
        return t.numel() * t.element_size()

    # -- gradients ------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        (self.grad_shard if self.grad_full is None else self.grad_full).zero_()

    def add_grad(self, p: nn.Parameter) -> None:
        if self.stage == 1:
            p.main_grad.add_(p.grad)
        else:
            if not hasattr(self, "_staged"):
                self._staged = {}
            self._staged[id(p)] = p.grad

    def grad_to_reduce(self) -> torch.Tensor:
        """The buffer to reduce-scatter: the persistent one (ZeRO-1) or a fresh flat copy of
        this micro-batch's gradients (ZeRO-2/3; parameters without a gradient count as 0)."""
        if self.stage == 1:
            return self.grad_full
        # empty, not zeros: every element is written below (a copy, or 0 for the padding and
        # for parameters without a gradient), which saves a full pass over the buffer; with
        # aligned parameters the gaps between them are zeroed as a whole instead
        make = torch.zeros if self.aligned else torch.empty
        flat = make(self.padded, dtype=self.reduce_dtype, device=self.grad_shard.device)
        staged = getattr(self, "_staged", {})
        for p, off in zip(self.params, self.offsets, strict=True):
            g = staged.get(id(p))
            view = flat[off : off + p.numel()]
            if g is not None:
                view.copy_(g.flatten())
            else:
                view.zero_()
        flat[self.offsets[-1] + self.params[-1].numel() :].zero_()
        self._staged = {}
        return flat

    def take_reduced(self, flat: torch.Tensor) -> None:
        if self.stage >= 2:
            self.grad_shard.add_(flat[self.lo : self.hi])

    # -- optimizer ------------------------------------------------------------------------------
    def pieces(self) -> list[tuple[str, nn.Parameter, int, int, int]]:
        """(name, parameter, start, stop, at) for every parameter overlapping this rank's
        slice: elements [start, stop) of the flattened parameter sit at shard[at : at +
        stop - start] (and their reduced gradient at grad_shard[the same range])."""
        out = []
        for (name, *_, p), off in zip(self.entries, self.offsets, strict=True):
            lo, hi = max(off, self.lo), min(off + p.numel(), self.hi)
            if lo < hi:
                out.append((name, p, lo - off, hi - off, lo - self.lo))
        return out

    def targets(self) -> list[Target]:
        """One target per parameter piece inside this rank's slice (decay decided per piece)."""
        out = []
        for name, p, start, stop, a in self.pieces():
            if not p.requires_grad:
                continue
            b = a + stop - start
            out.append(
                Target(
                    self.shard[a:b],
                    (lambda a=a, b=b: self.grad_shard[a:b]),
                    p.ndim >= 2,
                    getattr(p, "tp_kind", "replica"),
                    name=name,
                    span=(start, stop),
                )
            )
        return out
