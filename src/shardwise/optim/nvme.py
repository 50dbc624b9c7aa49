"""AdamW whose fp32 masters and moments live on local disk (`memory.offload=optimizer+nvme`,
ZeRO-Infinity's optimizer offload: Rajbhandari et al. 2021).

Each rank keeps one file in a folder of its own under `memory.nvme_dir`: three flat fp32
regions (masters, first moments, second moments) over every target this rank steps, in
target order. The file's space is reserved when it is made (a disk without room fails then,
naming the folder, not with a crash mid-step) and the folder is removed when the run ends;
nothing else in `memory.nvme_dir` is touched.

A step streams the regions through two host slots of `memory.nvme_buffer_mb` per region
each (one when everything fits in one): while one chunk is updated, a background thread
writes the previous chunk back and reads the next one, so the disk works while the CPU does.
Within a chunk each target's part is stepped by torch's fused AdamW (the kernel of
`torch.optim.AdamW(fused=True)`, which host offload runs), element-wise, so the result is
bitwise that of host offload. Host memory for the state is the two slots.

Reads and writes go through the file's memory mapping (the OS page cache, no O_DIRECT):
recently used state may stay cached while RAM is spare; it is the kernel's to reclaim. The
checkpoint code reads and writes masters and moments through the same mapping.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.optim.adamw import adamw as adamw_kernel

from shardwise.errors import ConfigError

CHUNK = 1 << 22  # elements per slot and region by default: 16 MB of fp32 (memory.nvme_buffer_mb)


def chunk_elements(buffer_mb: float) -> int:
    """fp32 elements per region of one host buffer for `memory.nvme_buffer_mb`."""
    return max(1, int(buffer_mb * 1024 * 1024) // 4)


class NvmeAdamW:
    """Masters and AdamW moments of `sizes` elements each (one entry per target) on disk."""

    def __init__(self, root: str, rank: int, shapes: list[torch.Size], chunk: int = CHUNK) -> None:
        self.shapes = shapes
        self.sizes = [int(s.numel()) for s in shapes]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.n = self.offsets[-1]
        self.chunk = max(1, min(chunk, self.n or 1))
        self.folder = _own_folder(root, rank)
        path = self.folder / "adamw_state.f32"
        _reserve(path, 3 * self.n * 4, root, "optimizer state", self.close)
        self.flat = torch.from_file(str(path), shared=True, size=3 * self.n, dtype=torch.float32)
        self.flat.zero_()
        self.masters = [self._view(0, i) for i in range(len(shapes))]
        self.exp_avg = [self._view(1, i) for i in range(len(shapes))]
        self.exp_avg_sq = [self._view(2, i) for i in range(len(shapes))]
        chunks = -(-self.n // self.chunk) if self.n else 0
        self.slots = [torch.empty(3, self.chunk) for _ in range(min(2, chunks))]
        self._io = ThreadPoolExecutor(1, thread_name_prefix="shardwise-nvme")

    def _view(self, region: int, i: int) -> torch.Tensor:
        lo = region * self.n + self.offsets[i]
        return self.flat[lo : lo + self.sizes[i]].view(self.shapes[i])

    @property
    def disk_bytes(self) -> int:
        return 3 * self.n * 4

    @property
    def buffer_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slots)

    def zero_moments(self) -> None:
        self.flat[self.n :].zero_()

    # -- the step ------------------------------------------------------------------------------
    def _read(self, lo: int, hi: int, slot: torch.Tensor) -> None:
        for r in range(3):
            slot[r, : hi - lo].copy_(self.flat[r * self.n + lo : r * self.n + hi])

    def _write(self, lo: int, hi: int, slot: torch.Tensor) -> None:
        for r in range(3):
            self.flat[r * self.n + lo : r * self.n + hi].copy_(slot[r, : hi - lo])

    @torch.no_grad()
    def step(
        self,
        grads: list[torch.Tensor],
        params: list[torch.Tensor],
        decay: list[float],
        step: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
    ) -> None:
        """One AdamW step of every target (`step`: the count before it, as torch keeps it),
        each updated master copied into its parameter (`params`, any dtype and device)."""
        chunks = [(lo, min(lo + self.chunk, self.n)) for lo in range(0, self.n, self.chunk)]
        if not chunks:
            return
        pending = self._io.submit(self._read, *chunks[0], self.slots[0])
        for k, (lo, hi) in enumerate(chunks):
            pending.result()  # chunk k is in its slot (and chunk k-2's write is done)
            slot = self.slots[k % 2]
            if k + 1 < len(chunks):  # FIFO: after chunk k-1's write to the other slot
                pending = self._io.submit(self._read, *chunks[k + 1], self.slots[(k + 1) % 2])
            self._step_chunk(lo, hi, slot, grads, params, decay, step, lr, beta1, beta2, eps)
            written = self._io.submit(self._write, lo, hi, slot)
        written.result()
        pending.result()

    def _step_chunk(self, lo, hi, slot, grads, params, decay, step, lr, beta1, beta2, eps):
        for i in range(len(self.sizes)):
            a, b = max(lo, self.offsets[i]), min(hi, self.offsets[i + 1])
            if a >= b:
                continue
            part = slice(a - self.offsets[i], b - self.offsets[i])
            g = grads[i].reshape(-1)[part].to("cpu", torch.float32)
            master, m, v = (slot[r, a - lo : b - lo] for r in range(3))
            adamw_kernel(
                [master],
                [g],
                [m],
                [v],
                [],
                [torch.tensor(float(step))],
                fused=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=lr,
                weight_decay=decay[i],
                eps=eps,
                maximize=False,
            )
            params[i].view(-1)[part].copy_(master, non_blocking=True)

    def close(self) -> None:
        """Remove this rank's folder (ours: made by `_own_folder`, holding only our file)."""
        if getattr(self, "_io", None) is not None:
            self._io.shutdown(wait=True)
        self.flat = None
        shutil.rmtree(self.folder, ignore_errors=True)


class NvmeUpdate:
    """optim/update.TorchUpdate's part for AdamW on disk (`NvmeAdamW`): the gradients stay
    where they are, and the step streams masters and moments through the host slots, chunk by
    chunk, into the parameters."""

    separate_master = True
    inner = None  # no torch optimizer: the AdamW kernel runs chunk by chunk

    def __init__(self, targets: list, cfg, root: str, rank: int) -> None:
        self.params = [t.param for t in targets]
        chunk = chunk_elements(cfg.memory.nvme_buffer_mb)
        self.disk = NvmeAdamW(root, rank, [p.shape for p in self.params], chunk)
        self.masters = self.disk.masters
        self._index = {id(m): i for i, m in enumerate(self.masters)}
        for m, p in zip(self.masters, self.params, strict=True):
            m.copy_(p.detach())
        self.steps, self.lr = 0, cfg.train.lr
        self.decay = [cfg.optim.weight_decay if t.decay else 0.0 for t in targets]
        self.hyper = (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps)

    def take_grads(self, targets: list) -> list[torch.Tensor]:
        return [t.grad() for t in targets]

    def apply(self, grads: list[torch.Tensor]) -> None:
        self.disk.step(grads, self.params, self.decay, self.steps, self.lr, *self.hyper)
        self.steps += 1

    def release_grads(self) -> None:
        pass

    @property
    def master_bytes(self) -> int:  # in host memory: the masters' row of the two slots
        return self.disk.buffer_bytes // 3

    @property
    def state_bytes(self) -> int:  # the moments' rows of the two slots
        return self.disk.buffer_bytes * 2 // 3

    @property
    def disk_bytes(self) -> int:
        return self.disk.disk_bytes

    def adam_steps(self) -> int:
        return self.steps

    def quantised(self, master: torch.Tensor) -> bool:
        return False

    def moments(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the state on disk: a checkpoint's load writes them in place."""
        i = self._index[id(master)]
        return {"exp_avg": self.disk.exp_avg[i], "exp_avg_sq": self.disk.exp_avg_sq[i]}

    def store_moments(self, master: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        pass

    def fresh_state(self, step: int) -> None:
        self.disk.zero_moments()
        self.steps = step

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def close(self) -> None:
        self.disk.close()


class DiskTensors:
    """Tensors backed by files of their own in one folder of this rank's under `root`
    (`memory.offload=params+nvme`: ZeRO-3's parameter slices). Each file's space is reserved
    when it is made; the folder goes when the run ends."""

    def __init__(self, root: str, rank: int, what: str = "params") -> None:
        self.root, self.folder, self.what = root, _own_folder(root, rank, what), what
        self.nbytes = 0
        self._count = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        path = self.folder / f"{self.what}{self._count:05d}.bin"
        self._count += 1
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        _reserve(path, nbytes, self.root, self.what, self.close)
        self.nbytes += nbytes
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _reserve(path: Path, nbytes: int, root: str, what: str, undo) -> None:
    """Create `path` (never an existing file) with `nbytes` of disk reserved, or raise the
    one message naming the folder (after `undo`, which removes ours)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)  # the room, now: never a SIGBUS mid-step
    except OSError as exc:
        os.close(fd)
        undo()
        raise ConfigError(
            f"memory.nvme_dir='{root}' cannot hold this rank's {what} ({nbytes / 1e9:.2f} GB "
            f"more): {exc.strerror}. Fix: free space there, point --memory.nvme_dir at a "
            "larger local disk, or offload to host memory (--memory.offload=optimizer)."
        ) from None
    os.close(fd)


def _own_folder(root: str, rank: int, what: str = "optimizer") -> Path:
    base = Path(root)
    try:
        base.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"shardwise-nvme-{what}-rank{rank}-", dir=base))
    except OSError as exc:
        raise ConfigError(
            f"memory.nvme_dir='{root}' is not a folder this job can write into: "
            f"{exc.strerror}. Fix: --memory.nvme_dir=<a writable local disk path>."
        ) from None
