"""`cpu` hardware measured on the spot: matmul FLOP/s, memory bandwidth, gloo bandwidth.

A few seconds of measurement (gloo with a second process), cached per machine (host name, core
count, torch version) in `$SHARDWISE_CACHE/calibration-cpu.json`, so later plans reuse it.
CPU ranks run one intra-op thread each (device.set_cpu_threads), so every rate is measured on
one thread; ranks beyond the core count share cores (Hardware.cores), which the time model
accounts for.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from shardwise.distributed.device import dtype_of
from shardwise.plan.cache import cache_file, machine_key, one_thread


def _rate(fn, work: float, seconds: float) -> float:
    """`work` units per CPU-second of `fn`: the best of repeated timings within `seconds` of
    this thread's CPU time. CPU time, not wall-clock: on a shared machine the wall clock
    mostly measures the other jobs (the benchmark compares with CPU time per step too)."""
    fn()  # warm-up (allocation, kernel selection)
    best, deadline = float("inf"), time.thread_time() + seconds
    while time.thread_time() < deadline:
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return work / best


def _matmul_flops(dtype: torch.dtype, n: int = 384, seconds: float = 0.25) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return _rate(lambda: torch.mm(a, b), 2.0 * n**3, seconds)


def _block(dim: int, heads: int, ffn: int, b: int, s: int, precision: str):
    """A decoder block's forward + backward (norms, RoPE, attention, SwiGLU, casts) and its
    FLOPs (6 per parameter per token + 12·h·s attention, PaLM app. B)."""
    from shardwise.models.decoder import Block
    from shardwise.models.presets import ModelSpec

    spec = ModelSpec("decoder", 1, dim, heads, heads, ffn, 4096, max(s, 8))
    dtype = dtype_of(precision)
    block = Block(spec).to(dtype)
    x = torch.randn(b, s, spec.dim, dtype=dtype, requires_grad=True)
    params = sum(p.numel() for p in block.parameters())

    def step() -> None:
        block(x).float().sum().backward()

    return step, (6.0 * params + 12.0 * dim * s) * b * s


def _block_overhead(seconds: float = 0.2) -> float:
    """CPU seconds of a block's forward + backward whose arithmetic is negligible: the fixed
    cost (Python, dispatch, autograd bookkeeping) every layer pays per micro-batch."""
    step, _ = _block(16, 2, 32, 1, 4, "fp32")
    return 1.0 / _rate(step, 1.0, seconds)


def _block_efficiency(precision: str, peak: float, overhead: float, seconds=0.6) -> float:
    """Achieved / matmul-peak FLOP/s of a whole mid-sized block, its fixed cost taken out:
    the share of a training step's arithmetic that runs at matmul speed on this CPU."""
    step, flops = _block(384, 6, 1024, 4, 128, precision)
    seconds_per_step = 1.0 / _rate(step, 1.0, seconds)
    return flops / max(seconds_per_step - overhead, 1e-9) / peak


def _memory_bw(seconds: float = 0.2) -> float:
    """Bytes/s of an element-wise kernel (read two, write one): the bound of norms, softmax,
    casts and the optimizer step."""
    n = 4 * 2**20
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    return _rate(lambda: torch.add(a, b, out=out), 12.0 * n, seconds)


def _gloo_ops(group, nbytes: int, reps: int, calls: int) -> dict[str, float]:
    """The collectives both calibration ranks run in the same order; this rank's median
    wall-clock seconds per call: a one-element all-reduce (`latency`), all-reduces of
    `nbytes` / 16 and `nbytes`, and a reduce-scatter and an all-gather of `nbytes`."""
    full, half = torch.ones(nbytes // 4), torch.ones(nbytes // 8)
    small = torch.ones(nbytes // 64)
    ops = {
        "latency": (lambda: group.allreduce([torch.ones(1)]), calls),
        "all_reduce_small": (lambda: group.allreduce([small]), reps),
        "all_reduce": (lambda: group.allreduce([full]), reps),
        "reduce_scatter": (lambda: group._reduce_scatter_base(half, full), reps),
        "all_gather": (lambda: group._allgather_base(full, half), reps),
    }
    ops["latency"][0]().wait()  # connect and warm up
    out = {}
    for name, (op, n) in ops.items():
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            op().wait()
            times.append(time.perf_counter() - t0)
        out[name] = sorted(times)[len(times) // 2]
    out["sync"] = _loaded_sync(group)
    return out


def _loaded_sync(group, segments: int = 16, rounds: int = 5) -> float:
    """What a synchronising call costs when the ranks arrive from compute, as training ranks
    do: both run `segments` forward + backward passes of a small decoder block (~10 ms on one
    core: what a rank computes between two tensor-parallel all-reduces of a small model),
    once with a one-element all-reduce after each and once without; the median over `rounds`
    of the difference per call: the wake-up of the rank that waits and the skew between the
    two ranks' passes, which an idle ping-pong does not see (it varied 0.2-3.9 ms between
    runs on one host where this varied 0.5-2 ms)."""
    piece, _ = _block(256, 4, 704, 1, 128, "fp32")
    piece()
    one = torch.ones(1)
    extra = []
    for _ in range(rounds):
        group.allreduce([one]).wait()  # start both loops together
        t0 = time.perf_counter()
        for _ in range(segments):
            piece()
        alone = time.perf_counter() - t0
        group.allreduce([one]).wait()
        t0 = time.perf_counter()
        for _ in range(segments):
            piece()
            group.allreduce([one]).wait()
        extra.append((time.perf_counter() - t0 - alone) / segments)
    return max(0.0, sorted(extra)[len(extra) // 2])


def _gloo_peer(port: int, nbytes: int, reps: int, calls: int) -> None:
    """Rank 1 of the calibration pair, in its own process."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=60))
    _gloo_ops(
        dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60)), nbytes, reps, calls
    )


def _gloo_timings(nbytes: int, reps: int, calls: int) -> dict[str, float]:
    """`_gloo_ops` on two gloo ranks over loopback in two processes, as training ranks run
    (a wake-up across processes costs more than across threads); this process is rank 0."""
    import multiprocessing

    import torch.distributed as dist

    from shardwise.distributed.store import listening_store

    # on loopback only, at a port the kernel picks and this process holds from the start
    store = listening_store("127.0.0.1", 0, 60.0)
    peer = multiprocessing.get_context("spawn").Process(
        target=_gloo_peer, args=(store.port, nbytes, reps, calls), daemon=True
    )
    peer.start()
    try:
        timeout = datetime.timedelta(seconds=60)
        return _gloo_ops(dist.ProcessGroupGloo(store, 0, 2, timeout), nbytes, reps, calls)
    finally:
        peer.join(timeout=60)
        if peer.is_alive():
            peer.kill()


def _gloo(nbytes: int = 4 * 2**20, reps: int = 9, calls: int = 100) -> dict[str, float]:
    """Gloo between two processes over loopback, as an alpha-beta model: the latency of one
    call (a one-element all-reduce), the ring bus bandwidth (bytes/s per rank per direction:
    an all-reduce of S bytes over 2 ranks moves S) from the growth of the all-reduce's time
    between S/16 and S, and what a reduce-scatter and an all-gather cost per ring byte
    relative to it (gloo's run well above the ring model's half an all-reduce). Medians of
    wall-clock times: that is what a rank waits for."""
    for _ in range(3):
        t = _gloo_timings(nbytes, reps, calls)
        grew = t["all_reduce"] - t["all_reduce_small"]
        if grew > 0:
            break
    # if noise hid the growth three times: the bandwidth as if the call were all bytes (a
    # lower bound), never the near-infinite 15/16 S over ~0
    bw = (nbytes - nbytes / 16) / grew if grew > 0 else nbytes / t["all_reduce"]
    # the line through the two all-reduces, at 0 bytes: what a call of the sizes training
    # sends (activations, gradient units) pays beyond its bytes; at least the tiny call's
    latency = max(t["latency"], t["all_reduce_small"] - nbytes / 16 / bw)
    # per ring byte against the all-reduce of the same S bytes (which moves twice as many):
    # a ratio of two times that both include a call's latency, so a noisy latency estimate
    # cannot push it to zero or below
    return {
        "gloo_bw": bw,
        "gloo_latency": latency,
        # a call met from compute costs at least an idle one-element call: a loaded machine's
        # noise can make the measured difference zero, which would price calls as free
        "gloo_sync": max(t.get("sync", latency), t["latency"]),
        "gloo_rs_cost": 2 * t["reduce_scatter"] / t["all_reduce"],
        "gloo_ag_cost": 2 * t["all_gather"] / t["all_reduce"],
    }


def measure() -> dict[str, float]:
    with one_thread():
        out = {
            "fp32": _matmul_flops(torch.float32),
            "bf16": _matmul_flops(torch.bfloat16, seconds=0.15),
            "fp16": _matmul_flops(torch.float16, n=128, seconds=0.1),
            "mem_bw": _memory_bw(),
        }
        out.update(_gloo())
        out["block_overhead"] = _block_overhead()
        out["eff_fp32"] = _block_efficiency("fp32", out["fp32"], out["block_overhead"])
        out["eff_bf16"] = _block_efficiency("bf16", out["bf16"], out["block_overhead"], 0.8)
        return out


def ram_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 << 30


def calibration(refresh: bool = False) -> dict[str, float]:
    """The cached measurement for this machine, measured now if missing or `refresh`."""
    path = cache_file("calibration-cpu.json")
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if not refresh and machine_key() in cached:
        return cached[machine_key()]
    from shardwise.plan import kernels  # which times its kernels with this module's helpers

    kernels.clear()  # block, head and optimizer times are measured again as well
    values = measure()
    cached[machine_key()] = values
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=2))
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time
    return values
