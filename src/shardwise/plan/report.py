"""What `shardwise plan` prints: the top-k table, one candidate in full, the rejected counts,
the ZeRO model-state table of `--params`, and what would be needed when nothing fits.

Memory is in GiB (2^30 bytes), as device memory is sold ("24 GB" cards hold 24 GiB), so a
card's figure reads as its data sheet's; only the ZeRO paper's table keeps its decimal GB."""

from __future__ import annotations

from shardwise.plan.hardware import GiB

CATEGORIES = ("params", "grads", "master", "optimizer", "activations", "buffers")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def _gb(n: float) -> str:  # decimal GB: the ZeRO paper's unit (states_table only)
    return f"{n / 1e9:.1f}"


def human_gib(n: float) -> str:
    """Bytes in binary units with the unit named: '512 B', '3.0 MiB', '24.0 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def why(rec: dict) -> str:
    """One line: the spare memory and where the step time goes beyond compute."""
    t = rec["time"]
    spare = rec["device_memory"] - rec["peak_bytes"]
    costs = {
        "bubble": t["bubble_s"],
        "tp comm": t["tp_comm_s"],
        "pp p2p": t["pp_comm_s"],
        "exposed dp comm": t["dp_exposed_s"],
        "optimizer": t["optimizer_s"],
        "offload": t["offload_s"],
        "NVMe": t.get("disk_s", 0.0),
        "compression": t.get("compression_s", 0.0),
        "cp attention": t.get("cp_attention_s", 0.0),
        "exposed cp comm": t.get("cp_exposed_s", 0.0),
        "exposed ep all-to-all": t.get("ep_exposed_s", 0.0),
    }
    step = rec["step_time_s"]
    top = sorted(((v, k) for k, v in costs.items() if v >= 0.005 * step), reverse=True)[:2]
    over = "".join(f", {k} {100 * v / step:.0f}%" for v, k in top)
    wire = rec.get("compression", "none")
    wire = f"; dp sends {wire}" if wire != "none" else ""
    return f"{_gib(spare)} GiB spare; compute {100 * t['compute_s'] / step:.0f}%{over}{wire}"


def _cp(r: dict) -> str:
    return f"{r['cp']} {r['cp_mode'][:4]}" if r.get("cp", 1) > 1 else "-"


def table(cands: list[dict], top: int) -> str:
    # a cp column where a shown candidate splits the sequence, an ep column where one splits
    # the experts (other tables read as before)
    with_cp = any(r.get("cp", 1) > 1 for r in cands[:top])
    with_ep = any(r.get("ep", 1) > 1 for r in cands[:top])
    cp_head = f" {'cp':>7}" if with_cp else ""
    cp_head += f" {'ep':>3}" if with_ep else ""
    head = (
        f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>5}{cp_head} {'zero':>4} {'schedule':>13} {'mb':>3} "
        f"{'recompute':>9} {'offload':>16} {'params':>7} {'grads':>6} {'optim':>6} "
        f"{'act':>6} {'peak GiB':>8} {'step s':>8} {'tok/s':>10} {'mfu':>5}  why"
    )
    lines = [head]
    for i, r in enumerate(cands[:top], 1):
        m = r["mem_bytes"]
        sched = (
            f"{r['pp_schedule']}" + (f" v{r['pp_virtual']}" if r["pp_virtual"] > 1 else "")
            if r["pp"] > 1
            else "-"
        )
        lines.append(
            f"{i:>3} {r['tp']:>3} {r['pp']:>3} {r['dp']:>5}"
            + (f" {_cp(r):>7}" if with_cp else "")
            + (f" {r.get('ep', 1):>3}" if with_ep else "")
            + f" {_zero(r):>4} {sched:>13} "
            f"{r['micro_batch']:>3} {r['recompute']:>9} {r['offload']:>16} "
            f"{_gib(m['params']):>7} {_gib(m['grads']):>6} "
            f"{_gib(m['master'] + m['optimizer']):>6} {_gib(m['activations']):>6} "
            f"{_gib(r['peak_bytes']):>8} {r['step_time_s']:>8.3g} {r['tokens_per_s']:>10,.0f} "
            f"{100 * r['mfu']:>4.0f}%  {why(r)}"
        )
    return "\n".join(lines)


def _zero(r: dict) -> str:
    """The ZeRO stage, or the stages that predict the same here ('1/2': one replica)."""
    return "/".join(str(z) for z in (r["zero"], *r.get("equivalent_zero", ())))


def train_flags(r: dict) -> list[str]:
    """The `shardwise train` overrides that run candidate `r`: every layout key, explicitly,
    so they win over any value a config file sets."""
    return [
        f"--parallel.tp={r['tp']}",
        f"--parallel.pp={r['pp']}",
        f"--parallel.zero={r['zero']}",
        f"--parallel.sp={str(r['sp']).lower()}",
        f"--parallel.pp_schedule={r['pp_schedule']}",
        f"--parallel.pp_virtual={r['pp_virtual']}",
        f"--parallel.grad_compression={r.get('compression', 'none')}",
        f"--parallel.cp={r.get('cp', 1)}",
        f"--parallel.cp_mode={r.get('cp_mode', 'ring')}",
        f"--parallel.ep={r.get('ep', 1)}",
        f"--train.micro_batch={r['micro_batch']}",
        f"--memory.recompute={r['recompute']}",
        f"--memory.offload={r['offload']}",
    ]


def rejected_lines(rejected: dict) -> str:
    if not rejected:
        return "rejected: none"
    parts = [f"  {n:>7,}  {reason}" for reason, n in sorted(rejected.items(), key=lambda x: -x[1])]
    return f"rejected {sum(rejected.values()):,} layouts:\n" + "\n".join(parts)


def explain_candidate(r: dict, n: int) -> str:
    cp = f" cp={r['cp']} ({r['cp_mode']})" if r.get("cp", 1) > 1 else ""
    cp += f" ep={r['ep']}" if r.get("ep", 1) > 1 else ""
    lines = [f"candidate #{n}: tp={r['tp']} sp={r['sp']} pp={r['pp']} dp={r['dp']}{cp}"]
    lines.append(
        f"  zero={_zero(r)} schedule={r['pp_schedule']} v={r['pp_virtual']} "
        f"micro_batch={r['micro_batch']} recompute={r['recompute']} offload={r['offload']} "
        f"compression={r.get('compression', 'none')}"
    )
    lines.append("  memory per rank (max over ranks):")
    for key, value in r["mem_bytes"].items():
        lines.append(f"    {key:<15} {human_gib(value):>10}  ({value:,} B)")
    lines.append(
        f"    {'+ backward transient, framework reserve, NCCL buffers':<15} -> peak "
        f"{human_gib(r['peak_bytes'])} of {human_gib(r['device_memory'])}"
    )
    lines.append("  step time:")
    for key, value in r["time"].items():
        lines.append(f"    {key:<15} {value:.4g} s")
    lines.append(
        f"  tokens/s {r['tokens_per_s']:,.0f}   mfu {100 * r['mfu']:.1f}%   "
        f"traffic/rank dp {human_gib(r['comm_bytes']['dp'])} tp "
        f"{human_gib(r['comm_bytes']['tp'])} pp {human_gib(r['comm_bytes']['pp'])}"
    )
    lines.append(f"  why: {why(r)}")
    return "\n".join(lines)


def states_table(rows: list[dict], params: int, devices: int) -> str:
    """The ZeRO paper's figure-1 accounting, in decimal GB per device (the paper's unit, said
    in the heading)."""
    lines = [
        f"model states per device: {params:,} parameters on {devices} devices, mixed-precision "
        "Adam (16-bit params and grads, fp32 master and moments; Rajbhandari et al. 2020 fig. 1); "
        "GB = 10^9 bytes, as the paper",
        f"{'stage':<8} {'params':>8} {'grads':>8} {'master':>8} {'optim':>8} {'total GB':>9}",
    ]
    for r in rows:
        m = r["mem_bytes"]
        name = "DDP" if r["zero"] == 0 else f"ZeRO-{r['zero']}"
        lines.append(
            f"{name:<8} {_gb(m['params']):>8} {_gb(m['grads']):>8} {_gb(m['master']):>8} "
            f"{_gb(m['optimizer']):>8} {_gb(m['total']):>9}"
        )
    return "\n".join(lines)


def misses(unfit: list[dict], k: int, memory: int, host: int) -> str:
    """The `k` layouts closest to fitting, and by how much they miss."""
    lines = [
        f"closest layouts that do not fit ({_gib(memory)} GiB device, "
        f"{_gib(host)} GiB host per device):"
    ]
    for r in unfit[:k]:
        overs = []
        if r["peak_bytes"] > memory:
            overs.append(f"device over by {_gib(r['peak_bytes'] - memory)} GiB")
        if r["host_bytes"] > host:
            overs.append(f"host over by {_gib(r['host_bytes'] - host)} GiB")
        where = ", ".join(overs)
        lines.append(
            f"  zero={r['zero']} mb={r['micro_batch']} recompute={r['recompute']:<9} "
            f"offload={r['offload']:<16} peak {_gib(r['peak_bytes'])} GiB, host "
            f"{_gib(r['host_bytes'])} GiB: {where}"
        )
    return "\n".join(lines)
