"""Everything device- and backend-specific lives here; CPU+gloo and CUDA+NCCL share the rest."""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass

import torch

from shardwise.errors import ConfigError

# Dense peak FLOP/s per dtype from vendor data sheets (SXM parts, no sparsity); used for MFU.
_PEAKS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12},
}


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cpu" | "cuda"
    backend: str  # "gloo" | "nccl"
    device: torch.device
    name: str

    def peak_flops(self, precision: str) -> float | None:
        """Dense peak FLOP/s for MFU, or None when unknown (CPUs)."""
        for key, peaks in _PEAKS.items():
            if key in self.name:
                return peaks[precision]
        return None


def detect(preference: str = "auto", local_rank: int = 0) -> DeviceInfo:
    """Choose the device for this rank: CUDA+NCCL when present (or asked for), else CPU+gloo."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "run.device='cuda' but no CUDA device is visible. Fix: --run.device=cpu or auto."
        )
    if preference in ("auto", "cuda") and torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return DeviceInfo(
            "cuda", "nccl", torch.device("cuda", index), torch.cuda.get_device_name(index)
        )
    return DeviceInfo("cpu", "gloo", torch.device("cpu"), "cpu")


# FP8 tensor-core matmuls (torch._scaled_mm, which torchao's float8 training calls) need
# compute capability 8.9 (Ada) or 9.0 and above (Hopper, Blackwell); A100s (8.0) have none
FP8_CAPABILITY = (8, 9)


def capability(info: DeviceInfo) -> tuple[int, int] | None:
    """The CUDA compute capability of `info`'s device, or None off CUDA."""
    if info.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(info.device))


def attention_with_lse(device_type: str):
    """(forward, backward) of a fused attention kernel that returns its rows' log-sum-exp
    and takes fp32 (what ring attention's blocks merge by), or None to compute the blocks
    unfused. CPU: ATen's flash kernel for the CPU. CUDA: None, its flash kernel takes 16-bit
    inputs only and the blocks run in fp32 (not measured here without a GPU)."""
    if device_type == "cpu":
        aten = torch.ops.aten
        return (
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward,
        )
    return None


def local_device_count() -> int:
    """Ranks to start on this machine by default: one per GPU, or 2 CPU ranks."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def dtype_of(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def synchronize(info: DeviceInfo) -> None:
    """Wait for queued device work, so wall-clock step times are honest."""
    if info.type == "cuda":
        torch.cuda.synchronize(info.device)


def to_host(src: torch.device, dst: torch.device) -> bool:
    """Whether a copy from `src` to `dst` brings a device's values to the host (the host
    waits for the device's queue; on CPU the values are on the host already)."""
    return src.type != "cpu" and dst.type == "cpu"


def stall_marker(info: DeviceInfo):
    """A function that records a timing event on the device's stream and returns it (CUDA),
    or None (CPU: host time is the device's). Two such events around a host wait measure how
    long the device sat idle because of it: the first completes when the work queued before
    the wait is done, the second when the host queued it after the wait (or later)."""
    if info.type != "cuda":
        return None

    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    return mark


def stalled_s(start, end) -> float:
    """Seconds between two marks on the device."""
    end.synchronize()  # (done already when the step synchronised)
    return max(0.0, start.elapsed_time(end) / 1e3)


def reset_peak_memory(info: DeviceInfo) -> None:
    if info.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)


def peak_memory(info: DeviceInfo) -> int | None:
    """The allocator's peak bytes since the last reset (CUDA only; CPU has no such counter)."""
    if info.type == "cuda":
        return int(torch.cuda.max_memory_allocated(info.device))
    return None


def release_cached_memory(info: DeviceInfo) -> None:
    """Hand the allocator's cached blocks back to the device (CUDA; a no-op on CPU): for a
    process that finished with a model while another process on the same device starts one."""
    if info.type == "cuda":
        torch.cuda.empty_cache()


def set_cpu_threads() -> None:
    """Several CPU ranks on few cores: one intra-op thread each unless the user set one."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


_ALLOWED_CORES: list[int] | None = None  # the cores this process could use before any pinning


def pin_cpu_cores(mode: str, local_rank: int, local_world: int) -> list[int] | None:
    """`run.cpu_affinity`: with "cores", pin every thread of this rank (compute, the transport's
    own threads, and any started later: threads inherit it) to the rank's equal share of the
    cores the process may use (local rank i gets cores i·k .. i·k + k − 1, k = cores // local
    ranks, at least 1; ranks beyond the cores share them round-robin). Returns the cores.

    Why: with a core per rank and no pinning, the scheduler runs the thread a message wakes
    (the receiver's gloo thread, then its training thread) on whichever core is free at that
    instant, which is often the sender's, so a busy rank is preempted on its own core by its
    peer and its short sends take milliseconds (measured: a pipeline rank's sends 2.5-5 ms each
    unpinned, 24 -> 9.5 ms a step pinned; benchmarks/pipeline_bubble.py). Not the default: on
    a machine shared with other jobs, fixed cores can be the busy ones. "none" leaves the
    affinity as the process found it (and undoes an earlier pinning of this process)."""
    global _ALLOWED_CORES
    if mode == "none" and _ALLOWED_CORES is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(
            f"run.cpu_affinity={mode}: this platform cannot pin threads to cores. "
            "Fix: --run.cpu_affinity=none."
        )
    if _ALLOWED_CORES is None:
        _ALLOWED_CORES = sorted(os.sched_getaffinity(0))
    allowed = _ALLOWED_CORES
    if mode == "none":
        cores = allowed
    else:
        k = max(1, len(allowed) // max(1, local_world))
        first = (local_rank * k) % len(allowed)
        cores = allowed[first : first + k]
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cores)
    return None if mode == "none" else cores


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64 bits
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20


def keep_freed_memory() -> bool:
    """Keep freed tensor memory in the process heap for the next step (glibc; CPU ranks).

    By default glibc serves large allocations with mmap and hands their pages back to the
    kernel on free, so every step page-faults its activations and gradients in again
    (measured on the tiny model: 4x the minor faults and ~20% of a step's time in the
    kernel). Allocations up to 32 MB (glibc's ceiling for this threshold) then come from the
    heap, which is trimmed only when over 1 GiB lies free at its top. The user's own MALLOC_*
    settings (or SHARDWISE_MALLOC=default) are left alone; False where nothing was changed
    (not glibc, or refused)."""
    if os.environ.get("SHARDWISE_MALLOC") == "default":
        return False
    if any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    )


def pin_socket_interface(interface: str) -> None:
    """Make gloo and NCCL's bootstrap use `interface` (the one that reaches the other nodes)
    unless the user chose one: by default they take the address the hostname resolves to,
    which on multi-homed hosts may not be reachable from the other nodes."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


# /proc/cpuinfo flags of matrix units for a low precision (x86: AVX-512 / AMX; Arm: SVE/NEON)
_UNITS = {
    "bf16": ("avx512_bf16", "amx_bf16", "bf16"),
    "fp16": ("avx512_fp16", "amx_fp16", "fphp", "asimdhp"),
}


def cpu_matrix_units() -> set[str]:
    """The low precisions ("bf16", "fp16") this CPU multiplies in hardware, from the flags
    the kernel reports (empty when it cannot tell)."""
    try:
        text = open("/proc/cpuinfo").read()  # noqa: SIM115 (read at once)
    except OSError:
        return set()
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
    return {p for p, names in _UNITS.items() if flags & set(names)}
