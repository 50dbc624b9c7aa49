"""Host syncs: what brings a tensor's values to the host during a step, counted by call site.

A read of a value the device computed makes the host wait for the device's queue: on an
accelerator the step's launches stop running ahead of its kernels. Counted, the same on every
device (a CPU run names the syncs a GPU run would make):

- a scalar read: `.item()`, `float()`, `int()`, `bool()`, `complex()` of a tensor or its use
  as an index (`__index__`), and `.tolist()`;
- an op whose result's size depends on the values (the host needs it to allocate the
  result): a boolean-mask index or assignment (`x[mask]`, `x[mask] = v`), `nonzero`,
  `argwhere`, `masked_select`, `unique`, `unique_consecutive`, one-argument `torch.where`,
  `repeat_interleave` by a tensor of repeats without `output_size`;
- a copy from the device to the host (`.cpu()`, `.to(...)`, `.copy_()` into a host tensor;
  none on CPU, where the values are on the host already: distributed/device.py decides).

How: while counting, these Python entry points of torch are wrapped (and restored after), on
the thread that entered: the rest of the step runs untouched, so the counter costs one check
per wrapped call (a dispatch mode that sees every op, tried first, added 6.9 us to each of
the ~2,600 ops of a small decoder's step: about half the step). Not seen: a read that C++
code makes without a Python call (a dispatch-level count of one process's steps, bf16, fp16,
full recomputation and MoE, found none there beyond these), `.numpy()` (on an accelerator
it needs a counted `.cpu()` first), and syncs inside a compiled graph (graph breaks run
eager and are counted).

A call site is the innermost Python frame outside torch: `optim/__init__.py:step` for the
package's own files (path under shardwise/), the path relative to the working directory (or
absolute) for a user's.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import torch

from shardwise.distributed import device as dev
from shardwise.distributed.frames import in_torch

_T = torch.Tensor
_SCALAR = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__")
_SIZED = ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive")

# the engine's own syncs per step: the optimizer's one transfer of [norm parts, loss] and the
# world's max of the step's memory statistics and stop signal (tests/test_optim_step.py); an
# MoE model adds one read of every layer's routing statistics (training/moe.py)
ENGINE_SITES = (
    "optim/__init__.py:step",
    "training/loop.py:_max_over_ranks",
    "training/moe.py:after_step",
)
# reads of index tensors that live on the host on every device (the sampler's batch, the
# dropout keys): on CPU the compute device is the host, so they count there; not the engine's
# device syncs, and never a finding
HOST_SIDE = ("data/sampler.py:", "models/dropout.py:")

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_THIS = __file__


def _always(args, kwargs, out) -> bool:
    return True


def _masked(args, kwargs, out) -> bool:
    """`x[i]` or `x[i] = v` with a boolean tensor among the indices."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, _T) and p.dtype == torch.bool for p in parts)


def _one_argument(args, kwargs, out) -> bool:
    return len(args) == 1 and not kwargs


def _repeats_by_tensor(args, kwargs, out) -> bool:
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
    return isinstance(repeats, _T) and kwargs.get("output_size") is None


def _to_host(args, kwargs, out) -> bool:
    """`.cpu()` / `.to()` whose result is on the host and its source was not."""
    return isinstance(out, _T) and dev.to_host(args[0].device, out.device)


def _copied_to_host(args, kwargs, out) -> bool:
    src = args[1] if len(args) > 1 else kwargs.get("src")
    return isinstance(src, _T) and dev.to_host(src.device, args[0].device)


def _patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, test of (args, kwargs, result)) of every entry point counted."""
    out: list[tuple[object, str, object]] = [(_T, name, _always) for name in _SCALAR]
    out += [(_T, name, _always) for name in _SIZED]
    out += [(torch, name, _always) for name in _SIZED]
    out += [(_T, "__getitem__", _masked), (_T, "__setitem__", _masked)]
    out += [(torch, "where", _one_argument)]
    out += [(_T, "repeat_interleave", _repeats_by_tensor)]
    out += [(torch, "repeat_interleave", _repeats_by_tensor)]
    out += [(_T, "cpu", _to_host), (_T, "to", _to_host), (_T, "copy_", _copied_to_host)]
    return out


class HostSyncs:
    """Counts host syncs by call site (`file:function`) while entered, on this thread."""

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self._names: dict[object, str | None] = {}  # code object -> its site (None: look out)
        self._saved: list[tuple[object, str, object]] = []
        self._thread = threading.get_ident()
        self._inside = False  # in a counted call: what it calls itself is the same sync

    def take(self) -> dict[str, int]:
        """The counts since the last take, by call site (then reset)."""
        out, self.sites = dict(self.sites), collections.Counter()
        return out

    def __enter__(self) -> HostSyncs:
        self._thread = threading.get_ident()
        for owner, name, test in _patches():
            # (restored as found: an attribute torch.Tensor inherits is deleted again)
            self._saved.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, self._wrap(getattr(owner, name), test))
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def _wrap(self, original, test):
        def counted(*args, **kwargs):
            if self._inside or threading.get_ident() != self._thread:
                return original(*args, **kwargs)
            self._inside = True
            try:
                out = original(*args, **kwargs)
            finally:
                self._inside = False
            if test(args, kwargs, out):
                self._count()
            return out

        return counted

    def _count(self) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            name = self._names.get(code, False)
            if name is False:
                name = self._names[code] = _site(code)
            if name is not None:
                self.sites[name] += 1
                return
            frame = frame.f_back


def _site(code) -> str | None:
    """`file:function` of a frame's code; None inside torch or this module (look further out)."""
    path = code.co_filename
    if in_torch(path) or path == _THIS:
        return None
    if path.startswith(_PACKAGE_DIR):
        path = path[len(_PACKAGE_DIR) :]
    elif os.path.isabs(path):
        rel = os.path.relpath(path)
        path = path if rel.startswith("..") else rel
    return f"{path}:{code.co_name}"


def is_package_site(site: str) -> bool:
    """Whether a site is in shardwise's own files (they are named by their path under it)."""
    path = site.rsplit(":", 1)[0]
    return not os.path.isabs(path) and os.path.isfile(_PACKAGE_DIR + path)


def unexpected(by_site: dict[str, float]) -> dict[str, float]:
    """The sites of `by_site` that are neither the engine's own nor host-side reads."""
    return {
        k: v for k, v in by_site.items() if k not in ENGINE_SITES and not k.startswith(HOST_SIDE)
    }


def summary(steps: list[dict[str, int]]) -> dict:
    """`host_syncs` of one rank in summary.json from its measured steps' counts by site:
    `per_step` (each step's total), `total`, `by_site` (mean per step), `engine_sites` and
    `unexpected` (the sites outside the engine's own and the host-side reads, mean per step)."""
    n = len(steps) or 1
    sites = sorted({k for s in steps for k in s})
    by_site = {k: round(sum(s.get(k, 0) for s in steps) / n, 3) for k in sites}
    return {
        "per_step": [sum(s.values()) for s in steps],
        "total": sum(sum(s.values()) for s in steps),
        "by_site": by_site,
        "engine_sites": list(ENGINE_SITES),
        "unexpected": unexpected(by_site),
    }
