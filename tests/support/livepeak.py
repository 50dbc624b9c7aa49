"""A meter of the tensors a piece of code makes: the bytes of those alive at once at the worst
moment, counted at PyTorch's dispatcher (any device, any library calling torch ops). Tests use
it to check the planner's transient terms against what another framework really allocates."""

from __future__ import annotations

import weakref

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LivePeak(TorchDispatchMode):
    """Bytes of the tensors made inside it that are alive at once, at the worst moment (a
    storage counts from the op that made it until Python frees it; views of earlier tensors
    count nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, Tensor)}  # fmt: skip
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in inputs or key in self.counted or st.nbytes() == 0:
                continue
            self.counted.add(key)
            self.live += st.nbytes()
            weakref.finalize(st, self._free, key, st.nbytes())
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.counted.discard(key)
        self.live -= nbytes
