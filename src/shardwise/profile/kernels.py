"""The traced step's ledger as the device saw it: from the GPU kernels in the torch.profiler
trace, not from the host's clock.

On CUDA the host runs ahead of the kernels, so the host ledger's split between forward,
backward and communication follows the launches. Here every instant of the traced step (the
`sw:step` range) is charged by what the device was doing:

- a compute kernel (or copy/memset) ran: the clock region that launched it (its launch call,
  matched by correlation id, lies inside the innermost `sw:<region>` range open then; the
  backward's kernels are launched from autograd's thread while the loop waits in `backward`);
- only communication kernels (NCCL) ran: exposed communication over the dimension of the
  `comm:<dim>` region that launched them (dp, tp, pp, cp, ep; the expert gradients' edp is
  dp's); a pipeline send/receive (or a collective launched inside a pipeline wait) is the
  stage waiting for its neighbours, `bubble` as in the host ledger (`comm_overlapped_s`
  counts NCCL time under compute: shown, not added);
- nothing ran: what the host was doing then (waiting for data, a pipeline neighbour, a
  collective) or, inside compute and optimizer regions, `launch_bound_s`: the device waited
  for the host's next launch.

The parts add up to the traced step's wall time exactly. A trace without kernels (CPU) has
no device ledger.
"""

from __future__ import annotations

import heapq
import itertools

from shardwise.profile.ledger import DIMS, seconds6

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
_COMPUTE = ("forward", "backward", "recompute")
_OWN = ("bubble", "data", "optimizer", "checkpoint", "eval", "launch_bound")  # host parts
_BUSY_HOST = {*_COMPUTE, "optimizer"}  # host regions where an idle device waits on its launches


def device_ledger(trace: dict) -> dict | None:
    """The ledger of the trace's `sw:step` range from its device events, or None when the
    trace has no step range or no kernels in it."""
    events = trace.get("traceEvents", [])
    ranges = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"][3:])
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith("sw:")
    ]
    steps = [r for r in ranges if r[2] == "step"]
    if not steps:
        return None
    lo, hi, _ = steps[-1]
    regions = [r for r in ranges if r[2] != "step"]
    launched = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    device = []  # (start, end, name, launch time or None), clipped to the step
    for e in events:
        if e.get("cat") not in _DEVICE_CATS or e.get("ph") != "X":
            continue
        a = max(lo, float(e["ts"]))
        b = min(hi, float(e["ts"]) + float(e.get("dur", 0)))
        if b > a:
            at = launched.get(e.get("args", {}).get("correlation"))
            device.append((a, b, str(e.get("name", "")), at))
    if not device:
        return None
    # the region that launched each one (none found: `other`)
    found = _innermost(regions, [at if at is not None else float("-inf") for *_, at in device])
    kernels = [
        (a, b, _kind(name), region) for (a, b, name, _), region in zip(device, found, strict=True)
    ]
    return _sweep(lo, hi, kernels, regions)


def _kind(name: str) -> str:
    """compute, nccl (a collective) or p2p (NCCL's send/receive: the pipeline's)."""
    low = name.lower()
    if not low.startswith("nccl"):
        return "compute"
    return "p2p" if "send" in low or "recv" in low else "nccl"


def _innermost(regions: list[tuple[float, float, str]], times: list[float]) -> list[str]:
    """For each host time, the region open then that began last (regions nest in time;
    `other` where none is open): one sweep over both, sorted."""
    order = sorted(range(len(times)), key=times.__getitem__)
    starts = sorted(regions)
    out = ["other"] * len(times)
    open_: list[tuple[float, float, str]] = []  # (-start, end, name): the latest start on top
    nxt = 0
    for i in order:
        t = times[i]
        while nxt < len(starts) and starts[nxt][0] <= t:
            a, b, name = starts[nxt]
            heapq.heappush(open_, (-a, b, name))
            nxt += 1
        while open_ and open_[0][1] <= t:  # ended (and stays so: times only grow)
            heapq.heappop(open_)
        if open_:
            out[i] = open_[0][2]
    return out


def _sweep(lo: float, hi: float, kernels: list, regions: list) -> dict:
    """Charge every elementary interval of [lo, hi) once (times in microseconds)."""
    charged: dict[str, float] = {}
    idle: dict[str, float] = {}  # the part of `charged` when no kernel ran
    overlapped = dict.fromkeys(DIMS, 0.0)
    marks = sorted(
        {lo, hi}
        | {t for k in kernels for t in k[:2]}
        | {t for r in regions for t in r[:2] if lo < t < hi}
    )
    pairs = list(itertools.pairwise(marks))
    hosts = _innermost(regions, [(a + b) / 2 for a, b in pairs])
    order = sorted(range(len(kernels)), key=lambda i: kernels[i][0])
    active: list[tuple[float, int]] = []  # (end, index) of kernels started by now
    nxt = 0
    for (a, b), host in zip(pairs, hosts, strict=True):
        while nxt < len(order) and kernels[order[nxt]][0] <= a:
            heapq.heappush(active, (kernels[order[nxt]][1], order[nxt]))
            nxt += 1
        while active and active[0][0] <= a:
            heapq.heappop(active)
        running = [kernels[i] for _, i in active]
        compute = [k for k in running if k[2] == "compute"]
        comm = [k for k in running if k[2] != "compute"]
        if compute:
            key = min(compute)[3]  # the earliest-started one's region
            for dim in {_dim(k[3]) for k in comm} - {None}:
                overlapped[dim] += b - a
        elif comm:
            key = _comm_key(min(comm))
        else:
            dim = _dim(host)  # (a host wait in a collective: its ledger dimension)
            key = "launch_bound" if host in _BUSY_HOST else f"comm:{dim}" if dim else host
            idle[key] = idle.get(key, 0.0) + (b - a)
        charged[key] = charged.get(key, 0.0) + (b - a)
    ledger = _ledger((hi - lo) / 1e6, _seconds(charged), overlapped)
    # which of it the device sat idle: a profiled step's host runs slower than an unprofiled
    # one, which the device sees as idle
    ledger["idle_s"] = _idle_parts(_seconds(idle))
    return ledger


def _idle_parts(idle: dict[str, float]) -> dict[str, float]:
    """The device's idle seconds by the ledger's parts (comm dims as `comm_exposed_s.<dim>`);
    no compute part: an idle device under a compute region is launch-bound (`_BUSY_HOST`)."""
    r = seconds6
    out = {f"{k}_s": r(idle.pop(k, 0.0)) for k in _OWN}
    out["straggler_wait_s"] = 0.0
    exposed = {f"comm_exposed_s.{d}": r(idle.pop(f"comm:{d}", 0.0)) for d in DIMS}
    out["other_s"] = r(sum(v for k, v in idle.items() if k not in _COMPUTE))
    return {**out, **exposed}


def _comm_key(kernel: tuple) -> str:
    """Where communication alone on the device goes: the dimension of the `comm:<dim>`
    region that launched it; a pipeline send/receive, or a collective launched inside a
    pipeline wait (the stage's start alignment, the loss all-reduce), is the stage waiting
    for its neighbours (`bubble`, as in the host ledger); else `other`."""
    _, _, kind, region = kernel
    dim = _dim(region)
    if dim is not None:
        return f"comm:{dim}"
    return "bubble" if kind == "p2p" or region == "bubble" else "other"


def _seconds(us: dict[str, float]) -> dict[str, float]:
    return {k: v / 1e6 for k, v in us.items()}


def _dim(region: str) -> str | None:
    """The ledger dimension of a `comm:<dim>` region (the expert gradients' `edp` is dp's)."""
    dim = region.removeprefix("comm:")
    dim = "dp" if dim == "edp" else dim
    return dim if region.startswith("comm:") and dim in DIMS else None


def _ledger(step_s: float, charged: dict[str, float], overlapped: dict[str, float]) -> dict:
    r = seconds6
    parts = {f"{k}_s": r(charged.pop(k, 0.0)) for k in _COMPUTE}
    exposed = {d: r(charged.pop(f"comm:{d}", 0.0)) for d in DIMS}
    own = {f"{k}_s": r(charged.pop(k, 0.0)) for k in _OWN}
    return {
        "step_s": r(step_s),
        "compute_s": r(sum(parts.values())),
        **parts,
        "comm_exposed_s": exposed,
        "comm_overlapped_s": {d: r(overlapped[d] / 1e6) for d in DIMS},
        **own,
        "straggler_wait_s": 0.0,
        "other_s": r(sum(charged.values())),  # comm:world, unclaimed regions
    }
