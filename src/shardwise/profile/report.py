"""What a person reads first: the ledger per rank as a table (terminal and report.md), the
findings, and two pictures: the stacked ledger of every rank and one step's timeline."""

from __future__ import annotations

from pathlib import Path

from shardwise.profile.analyze import mean_ledger

# The one statistic of the measured steps everywhere a profile speaks of a step time: the
# table, the findings' evidence and predictions, the MFU and --verify-remedy's verdict. The
# mean, because the ledger's parts add up to it (no median of them does).
STATISTIC = "mean"
# the columns of the table and the stacks of the picture, in order
COLUMNS = (
    ("compute", lambda s: s["compute_s"]),
    ("dp comm", lambda s: s["comm_exposed_s"]["dp"]),
    ("tp comm", lambda s: s["comm_exposed_s"]["tp"]),
    ("pp comm", lambda s: s["comm_exposed_s"]["pp"]),
    ("cp comm", lambda s: s["comm_exposed_s"].get("cp", 0.0)),
    ("ep comm", lambda s: s["comm_exposed_s"].get("ep", 0.0)),
    ("bubble", lambda s: s["bubble_s"]),
    ("data", lambda s: s["data_s"]),
    ("optimizer", lambda s: s["optimizer_s"]),
    ("checkpoint", lambda s: s["checkpoint_s"]),
    ("eval", lambda s: s["eval_s"]),
    ("straggler", lambda s: s["straggler_wait_s"]),
    ("other", lambda s: s["other_s"]),
)
COLOURS = {
    "compute": "#4c72b0",
    "dp comm": "#dd8452",
    "tp comm": "#c44e52",
    "pp comm": "#8172b3",
    "cp comm": "#e377c2",
    "ep comm": "#17becf",
    "bubble": "#bbbbbb",
    "data": "#55a868",
    "optimizer": "#937860",
    "checkpoint": "#da8bc3",
    "eval": "#8c8c8c",
    "straggler": "#ccb974",
    "other": "#64b5cd",
}
# the clock's categories in the timeline picture
_EVENT_COLUMN = {
    "forward": "compute",
    "backward": "compute",
    "recompute": "compute",
    "comm:dp": "dp comm",
    "comm:tp": "tp comm",
    "comm:pp": "pp comm",
    "comm:cp": "cp comm",
    "comm:ep": "ep comm",
    "comm:edp": "dp comm",  # the expert gradients' reduction: data-parallel (ledger.py)
}
# columns shown only where a rank spent time in them (runs without cp or ep)
_OPTIONAL = {"cp comm", "ep comm"}


def per_rank(summary: dict) -> list[tuple[int, dict]]:
    return [(r["rank"], mean_ledger([r])) for r in summary["ranks"] if r["steps"]]


def ledger_table(summary: dict) -> str:
    """Mean ms per step by category, one row per rank (and the MFU, where known)."""
    mfu = summary.get("mfu")
    title = f"{STATISTIC} ms per measured step" + (
        f" ({STATISTIC} MFU {100 * mfu:.1f}%)" if mfu else ""
    )
    return title + "\n" + _table(COLUMNS, per_rank(summary))


# the device ledger (kernels, CUDA) has no straggler split and adds the launch-bound time
DEVICE_COLUMNS = (
    *(c for c in COLUMNS if c[0] not in ("straggler", "other")),
    ("launch-bound", lambda s: s["launch_bound_s"]),
    ("other", lambda s: s["other_s"]),
)


def device_table(summary: dict) -> str | None:
    """The traced step of every rank as its device ran it (None without GPU kernels)."""
    rows = [(r["rank"], r["device_ledger"]) for r in summary["ranks"] if r.get("device_ledger")]
    if not rows:
        return None
    title = "ms of the traced step by what the device ran (CUDA kernels; see docs/profile.md)"
    return title + "\n" + _table(DEVICE_COLUMNS, rows)


def host_syncs_text(summary: dict) -> str | None:
    """Host syncs per measured step, one line per rank: the engine's own, any others, and the
    reads of host-side index tensors (mean per step, by call site); None where they were not
    counted (profile.host_syncs=false)."""
    rows = [(r["rank"], r["host_syncs"]) for r in summary["ranks"] if r.get("host_syncs")]
    if not rows:
        return None
    out = ["host syncs per measured step (mean, by call site file:function; docs/profile.md)"]
    for rank, h in rows:
        by_site, others = h["by_site"], h["unexpected"]
        engine = {s: n for s, n in by_site.items() if s in h["engine_sites"]}
        host = {s: n for s, n in by_site.items() if s not in engine and s not in others}
        groups = [("the engine's", engine), ("others", others), ("host-side index reads", host)]
        line = "; ".join(f"{name} {sum(d.values()):g} ({_sites(d)})" for name, d in groups if d)
        n = len(h["per_step"]) or 1
        out.append(f"rank {rank}: {h['total'] / n:g}: {line}")
    return "\n".join(out)


def _sites(counts: dict[str, float]) -> str:
    return ", ".join(f"{s} {n:g}" for s, n in counts.items())


def _table(columns, rows: list[tuple[int, dict]]) -> str:
    columns = _used(columns, rows)
    head = ["rank", "step", *(name for name, _ in columns)]
    out = [head]
    for rank, m in rows:
        out.append(
            [str(rank), f"{m['step_s'] * 1e3:.1f}"] + [f"{f(m) * 1e3:.1f}" for _, f in columns]
        )
    widths = [max(len(r[i]) for r in out) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in out)


def _used(columns, rows: list[tuple[int, dict]]) -> list:
    """`columns` less the optional ones no rank spent time in."""
    return [(n, f) for n, f in columns if n not in _OPTIONAL or any(f(m) for _, m in rows)]


def findings_text(findings: list[dict], top: int | None = None) -> str:
    if not findings:
        return "no cause takes 5% of the step or more: nothing to remedy."
    out = [f"findings (times: the {STATISTIC} of the measured steps over ranks, as the table):"]
    for i, f in enumerate(findings[:top], 1):
        fix = " ".join(f["remedy"]) if f["remedy"] else "(no config change: see the evidence)"
        out.append(
            f"{i}. {f['cause']}: {f['evidence']}\n   remedy: {fix}\n   predicted: "
            f"{STATISTIC} step {f['predicted_step_s'] * 1e3:.1f} ms "
            f"({100 * f['predicted_gain']:.0f}% less)"
        )
    return "\n".join(out)


def write_report(folder: Path, summary: dict, problems: list[str]) -> None:
    """report.md, ledger.png and timeline.png in `folder`."""
    _plot_ledger(summary, folder / "ledger.png")
    _plot_timeline(summary["timeline"], folder / "timeline.png")
    lines = [
        "# Profile",
        "",
        f"{summary['measured_steps']} measured steps on {summary['world']} rank(s) after "
        f"{summary['warmup']} warm-up steps; a further step ran under torch.profiler "
        "(trace_rank<R>.json; the merged timeline of all ranks is timeline.json).",
        "",
        "## Ledger",
        "",
        "```",
        ledger_table(summary),
        "```",
        "",
        "![ledger](ledger.png)",
        "",
        *_device_section(summary),
        *_syncs_section(summary),
        "## Findings",
        "",
        findings_text(summary["findings"]),
        "",
        "![one step](timeline.png)",
    ]
    if problems:
        lines += ["", "## Problems", ""] + [f"- {p}" for p in problems]
    (folder / "report.md").write_text("\n".join(lines) + "\n")


def _device_section(summary: dict) -> list[str]:
    table = device_table(summary)
    if table is None:
        return []
    return ["## The device's view", "", "```", table, "```", ""]


def _syncs_section(summary: dict) -> list[str]:
    text = host_syncs_text(summary)
    if text is None:
        return []
    return ["## Host syncs", "", "```", text, "```", ""]


def _plot_ledger(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = per_rank(summary)
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.5 * len(ranks)))
    for y, (_, m) in enumerate(ranks):
        left = 0.0
        for name, f in COLUMNS:
            width = f(m) * 1e3
            if width > 0:
                ax.barh(y, width, left=left, color=COLOURS[name], label=name if y == 0 else None)
                left += width
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r, _ in ranks])
    ax.set_xlabel(f"ms per step ({STATISTIC} of the measured steps)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=6, fontsize="small")
    fig.savefig(path, bbox_inches="tight", dpi=100)
    plt.close(fig)


def _plot_timeline(trace: dict, path: Path) -> None:
    """The first measured step of every rank (its intervals up to the first `data` after
    the step's optimizer, i.e. the next step's fetch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ranks = sorted({e["pid"] for e in events})
    end = _first_step_end(events)
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.5 * len(ranks)))
    seen = set()
    for e in events:
        if e["ts"] >= end:
            continue
        name = _EVENT_COLUMN.get(e["name"], e["name"])
        name = name if name in COLOURS else "other"
        ax.barh(
            ranks.index(e["pid"]),
            e["dur"] / 1e3,
            left=e["ts"] / 1e3,
            color=COLOURS[name],
            label=None if name in seen else name,
        )
        seen.add(name)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("ms since the ranks' common start")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=6, fontsize="small")
    fig.savefig(path, bbox_inches="tight", dpi=100)
    plt.close(fig)


def _first_step_end(events: list[dict]) -> float:
    """Where rank 0's second step begins: its first `data` after an `optimizer` interval."""
    after_optimizer = False
    for e in sorted((e for e in events if e["pid"] == events[0]["pid"]), key=lambda e: e["ts"]):
        if e["name"] == "optimizer":
            after_optimizer = True
        elif e["name"] == "data" and after_optimizer:
            return e["ts"]
    return float("inf")
