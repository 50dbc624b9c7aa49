"""One GPU, one command: how fast shardwise trains a decoder, eager and compiled, beside plain
PyTorch AMP and the planner's prediction.

What it measures, on one CUDA device: `shardwise train` of a decoder (default the 1b preset,
1.35B parameters, seq 2048, bf16) with `train.compile=false` and `train.compile=blocks`; the
same model trained by a plain PyTorch loop (`torch.autocast(bf16)` over fp32 parameters, fused
AdamW: benchmarks/cuda_profile.py's peer); and `shardwise explain`'s prediction for the config.
Per run: the median step after the warm-up steps, MFU under two FLOP conventions (shardwise's
6N + 12·L·h·s per token, attention included, and the 6N of the scaling-law papers), the
allocator's peak (`max_memory_allocated`), the ratio to the peer of the same shape, and the
planner's step for the run's own keys on this card (`explain` in process) with its ratio.
Where the card has FP8 tensor cores (compute capability 8.9+: H100, H200, L40S) and torchao is
installed, three more runs train with `precision.fp8` (torchao float8: the blocks' linear
layers in FP8): compiled blocks (where inductor fuses the casts into their neighbours) with
`tensorwise` and `rowwise`, and eager `tensorwise` (the unfused casts' cost); the MFU columns
keep the bf16 peak as denominator, so an FP8 run's MFU above the bf16 run's is its speed-up.
Last, `--llama3-layers K` (default 8; 0: off) trains a Llama-3-8B-shaped decoder (dim 4096,
32 heads, 8 kv heads, ffn 14336) trimmed to K layers, on the data's own vocabulary, eager
beside its own AMP peer, then with compiled blocks and compiled FP8 tensorwise. Where
torchtitan 0.3.0 is installed (benchmarks/gpu_wheels.sh), its Llama 3 model at the preset's
widths, parallelised and initialised by its own functions (its FSDP2 bf16 precision, its
compiled blocks and float8), trains in the peer's loop and data order, each run in a process
of its own: compiled and eager after the planner's row, compiled FP8 rowwise (the recipes its
converter offers) last; each is set beside our run of the same compile and FP8 as a ratio
(benchmarks/torchtitan_peer.py says what is torchtitan's in those rows).

The runs go in `plan_runs`' order, the most wanted first, each written to `--out DIR` as soon
as it is measured (`cuda_speed.jsonl`: one object per run, measured, skipped or failed;
`cuda_speed.md`: the table so far), so a run cut short still leaves every finished row.
`--budget-s S` skips a run whose estimated time (printed beside its wall time: see ESTIMATE)
no longer fits in what is left of S seconds, and says which were skipped and why; a failed
run is reported and the next one still runs. `--row FILE` appends each run of the preset as a
row of the published record. `--smoke` runs the tiny preset a few steps on whatever device
there is (CPU here, FP8 in numerics mode: emulated; the Llama-3 row at a tiny width): it shows
the script runs, its numbers mean nothing. benchmarks/cuda_run.sh runs it on a GPU machine.

    .venv/bin/python benchmarks/cuda_speed.py [--model 1b] [--seq 2048] [--micro 4]
        [--global-batch 8] [--steps 5] [--warmup 3] [--llama3-layers 8] [--budget-s 480]
        [--out DIR] [--row FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import torchtitan_peer
from common import add_smoke, preamble, table
from cuda_profile import _gb, _pct, add_run_args, overrides, peer, predicted, published_row
from cuda_profile import stream as stream_cli

LLAMA3 = ["--model.dim=4096", "--model.n_heads=32", "--model.n_kv_heads=8", "--model.ffn_dim=14336"]
# --smoke: the same head ratio (4 query heads per kv head) and ffn/dim (3.5) at a CPU's width
LLAMA3_SMOKE = [
    "--model.dim=64",
    "--model.n_heads=4",
    "--model.n_kv_heads=1",
    "--model.ffn_dim=224",
]

# Seconds a run is estimated to take on one H100/H200, for --budget-s, from the two H200 runs
# of 2026-11-29 (benchmarks/history/cuda_speed.md: each row's wall time beside the estimate it
# had then), rounded up to err long: a `shardwise train` of the 1b preset took 20-25 s eager
# (about 17 s before its first step), 29-33 s with compiled blocks (the compile 8-13 s on a
# fresh inductor cache), 27-47 s compiled with FP8 (its compile up to ~25 s), the peer 12-18 s;
# the data's first preparation (a 32000-token BPE on the stdlib, then encoding) took ~5 s on
# that machine's 16 cores; eager FP8's step was 2.4-2.6x eager bf16's. Steps are priced at 35 %
# MFU (measured 40-49 %). Each run prints its estimate beside its wall time.
ESTIMATE = {
    "start_s": 22.0,  # a `shardwise train` process before its first step
    "peer_start_s": 14.0,  # the peer in this process: build and init only
    "compile_s": 20.0,  # first compile of one block shape, forward and backward
    "fp8_compile_s": 30.0,  # the same with torchao's casts in the graph
    "prepare_s": 10.0,  # the data's first preparation
    "mfu": 0.35,  # below the 40-49 % measured, so estimates err long
    "fp8_eager_slowdown": 2.6,  # eager float8 runs its casts unfused
    "smoke_s": 15.0,  # any --smoke run on a CPU
}


@dataclass(frozen=True)
class Run:
    """One row: ours (`shardwise train`), the AMP peer, torchtitan, or the planner's step."""

    name: str
    kind: str  # "ours" | "peer" | "plan" | "titan" (torchtitan's model: torchtitan_peer.py)
    compile: str = "false"
    fp8: str = "none"
    llama3: bool = False


def plan_runs(a: argparse.Namespace) -> list[Run]:
    """Every run, the most wanted first: the bf16 table (eager, compiled, the peer, the
    planner), torchtitan compiled and eager, then FP8 (compiled first: eager float8 runs its
    casts unfused, so one eager recipe shows that cost), then the Llama-3 shape with its own
    peer, compiled and with FP8, last torchtitan's compiled FP8 (rowwise: the recipes its
    converter offers). --smoke leaves out what a CPU's compile would only slow: torchtitan
    compiled, the Llama-3 shape compiled, FP8 but one eager run."""
    runs = [
        Run("eager", "ours"),
        Run("compiled blocks", "ours", "blocks"),
        Run("PyTorch AMP (peer)", "peer"),
        Run("planner (explain, eager)", "plan"),
    ]
    if not a.smoke:
        runs += [Run("torchtitan: compiled blocks", "titan", "blocks")]
    runs += [Run("torchtitan: eager", "titan")]
    fp8 = [
        Run("compiled + FP8 tensorwise", "ours", "blocks", "tensorwise"),
        Run("compiled + FP8 rowwise", "ours", "blocks", "rowwise"),
        Run("eager + FP8 tensorwise", "ours", "false", "tensorwise"),
    ]
    runs += [r for r in fp8 if r.compile == "false"][:1] if a.smoke else fp8  # a CPU: one
    if a.llama3_layers:
        shape = "Llama-3 ratios, tiny widths" if a.smoke else "Llama-3-8B widths"
        shape += f", {a.llama3_layers} layer(s)"
        runs += [Run(f"{shape}: eager", "ours", llama3=True)]
        runs += [Run(f"{shape}: PyTorch AMP (peer)", "peer", llama3=True)]
        if not a.smoke:  # a CPU's compile of it says nothing and takes the smoke's time
            runs += [Run(f"{shape}: compiled blocks", "ours", "blocks", llama3=True)]
            runs += [
                Run(f"{shape}: compiled + FP8 tensorwise", "ours", "blocks", "tensorwise", True)
            ]
    if not a.smoke:
        runs += [Run("torchtitan: compiled + FP8 rowwise", "titan", "blocks", "rowwise")]
    return runs


def shape_args(a: argparse.Namespace, llama3: bool) -> list[str]:
    """The overrides that turn the preset into the run's shape."""
    if not llama3:
        return []
    return [f"--model.n_layers={a.llama3_layers}", *(LLAMA3_SMOKE if a.smoke else LLAMA3)]


def shape_facts(a: argparse.Namespace, folder: Path, llama3: bool) -> tuple[float, float]:
    """(attention's share of the 6N+12Lhs FLOPs, training FLOPs per step) of a shape: the
    share 12·L·h·s / (6N + 12·L·h·s) is what the 6N convention leaves out."""
    from shardwise.config import load_config
    from shardwise.models import build_model
    from shardwise.training.metrics import flops_per_token
    from shardwise.training.validate import derive

    d = derive(load_config(None, [*overrides(a, folder), *shape_args(a, llama3)]), 1)
    with torch.device("meta"):
        per_token = flops_per_token(build_model(d.spec), d)
    attn = 12 * d.spec.n_layers * d.spec.q_dim * d.tokens_per_sample
    return attn / per_token, per_token * d.tokens_per_step


def fp8_unavailable(smoke: bool) -> str:
    """Why no FP8 run can start here ("" when they can)."""
    from shardwise.distributed import device as dev
    from shardwise.parallel.fp8 import torchao_installed

    if not torchao_installed():
        return "torchao missing (the fp8 extra: torchao 0.18; benchmarks/gpu_wheels.sh)"
    info = dev.detect()
    cap = dev.capability(info)
    if cap is None and not smoke:
        return "no CUDA device"
    if cap is not None and cap < dev.FP8_CAPABILITY:
        return f"{info.name} has no FP8 tensor cores (compute capability {cap[0]}.{cap[1]})"
    return ""


def estimate_s(a: argparse.Namespace, run: Run, flops: float, peak: float | None) -> float:
    """Seconds `run` is expected to take on the device (ESTIMATE says where they come from),
    the data's first preparation not included."""
    e = ESTIMATE
    if a.smoke or not peak:
        return e["smoke_s"]
    if run.kind == "plan":
        return e["start_s"]
    step = flops / (e["mfu"] * peak)
    if run.fp8 != "none" and run.compile == "false":
        step *= e["fp8_eager_slowdown"]
    compile_s = e["fp8_compile_s"] if run.fp8 != "none" else e["compile_s"]
    start = e["peer_start_s"] if run.kind == "peer" else e["start_s"]  # titan: a process
    return start + (compile_s if run.compile == "blocks" else 0.0) + step * (a.warmup + a.steps)


def priced_s(a: argparse.Namespace, run: Run, folder: Path) -> float | None:
    """The planner's step for `run`'s keys on this machine's card, `explain` in this process
    (no start-up), beside each run of ours; None where it cannot price them (a card without
    FP8 peak for an FP8 run: the CPU of a smoke run)."""
    from shardwise.config import load_config
    from shardwise.errors import ConfigError
    from shardwise.job.explain import explain_record
    from shardwise.plan.hardware import detect_hardware

    keys = [*overrides(a, folder), *shape_args(a, run.llama3)]
    keys += [f"--train.compile={run.compile}", f"--precision.fp8={run.fp8}"]
    try:
        return explain_record(load_config(None, keys), 1, detect_hardware()).get("step_time_s")
    except ConfigError:
        return None
    except Exception as exc:  # the measured run stands without its price
        print(f"  planner for {run.name}: {type(exc).__name__}: {exc}", flush=True)
        return None


def train(a: argparse.Namespace, run: Run, folder: Path, timeout: float) -> dict:
    """One `shardwise train` run: median step after the warm-up, MFU and peak allocation."""
    steps = a.warmup + a.steps
    args = [*overrides(a, folder), *shape_args(a, run.llama3), f"--train.steps={steps}"]
    args += [f"--train.compile={run.compile}", f"--precision.fp8={run.fp8}", "--nproc=1"]
    args += ["--log.progress=off", "--log.tensorboard=false", "--log.every=1"]
    rc, tail = stream_cli(["train", *args], timeout)
    if rc:
        how = f"killed after {timeout:.0f} s (the budget)" if rc == -9 else f"exited {rc}"
        return {"status": "failed", "reason": f"shardwise train {how}: {tail}"}
    every = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in every if r["step"] > a.warmup]
    return {
        "status": "measured",
        "step_s": statistics.median(r["step_time_s"] for r in records),
        "mfu": statistics.median(r["mfu"] for r in records) if records[0]["mfu"] else None,
        "peak_bytes": max(r["mem_bytes"].get("device_peak", 0) for r in records) or None,
        "breaks": every[0].get("compile", {}).get("graph_breaks"),  # the first step says
        "plan_s": priced_s(a, run, folder),
    }


def torchtitan(a: argparse.Namespace, run: Run, folder: Path, timeout: float) -> dict:
    """One torchtitan row, in a process of its own (torchtitan_peer.py says why)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "torchtitan.json"
    args = [f"--model={a.model}", f"--seq={a.seq}", f"--micro={a.micro}"]
    args += [f"--global-batch={a.global_batch}", f"--precision={a.precision}"]
    args += [f"--steps={a.steps}", f"--warmup={a.warmup}", f"--compile={run.compile}"]
    args += [f"--fp8={run.fp8}", f"--shape={json.dumps(shape_args(a, run.llama3))}"]
    args += [f"--folder={folder}", f"--json={out}"]
    program = [str(Path(__file__).with_name("torchtitan_peer.py"))]
    rc, tail = stream_cli(args, timeout, program)
    if rc:
        how = f"killed after {timeout:.0f} s (the budget)" if rc == -9 else f"exited {rc}"
        return {"status": "failed", "reason": f"torchtitan_peer.py {how}: {tail}"}
    return {"status": "measured", **json.loads(out.read_text())}


def measure(a: argparse.Namespace, run: Run, folder: Path, timeout: float) -> dict:
    """Run one row; a failure is a row that says why, and the next run still starts."""
    from shardwise.distributed import device as dev

    try:
        if run.kind == "ours":
            return train(a, run, folder, timeout)
        if run.kind == "titan":
            return torchtitan(a, run, folder, timeout)
        if run.kind == "peer":
            try:
                r = peer(a, folder, a.warmup + a.steps, shape_args(a, run.llama3))
            finally:  # the next `shardwise train` needs the device's memory
                gc.collect()
                dev.release_cached_memory(dev.detect())
            return {"status": "measured", **r}
        plan = predicted(a, folder)
        return {
            "status": "measured",
            "step_s": plan["step_time_s"],
            "mfu": plan.get("mfu"),
            "peak_bytes": plan["mem_bytes"]["total"],
        }
    except (Exception, SystemExit) as exc:  # SystemExit: cuda_profile.shardwise() exits
        return {"status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[-400:]}"}


@dataclass
class Results:
    """The rows so far, written to `out` after every run (a timeout keeps what finished)."""

    out: Path
    shares: dict[bool, float]
    rows: list[tuple[Run, dict]]

    def add(self, run: Run, r: dict) -> None:
        self.rows.append((run, r))
        with (self.out / "cuda_speed.jsonl").open("a") as f:
            f.write(json.dumps({"run": run.name, **r}) + "\n")
        (self.out / "cuda_speed.md").write_text(self.markdown() + "\n")

    def peer_step(self, llama3: bool) -> float | None:
        return next(
            (r["step_s"] for run, r in self.rows if run.kind == "peer" and run.llama3 == llama3
             and r["status"] == "measured"),
            None,
        )  # fmt: skip

    def cells(self, run: Run, r: dict) -> list[str]:
        mfu, them = r["mfu"], self.peer_step(run.llama3)
        share = self.shares.get(run.llama3, 0.0)
        return [
            run.name, f"{r['step_s'] * 1e3:.1f}", _pct(mfu),
            "" if run.kind == "plan" else _pct(mfu * (1 - share) if mfu else None),
            _gb(r["peak_bytes"]), f"{r['step_s'] / them:.3f}" if them else "-",
            "-" if r.get("breaks") is None else str(r["breaks"]),
            f"{r['wall_s']:.0f} / {r['estimate_s']:.0f}", _planned(r),
        ]  # fmt: skip

    def against_torchtitan(self) -> list[str]:
        """A line per torchtitan row with a run of ours of the same compile and FP8: the
        ratio of our step to torchtitan's (below 1: ours is faster); then what its rows say
        of themselves (torchtitan_peer.stand_in)."""
        measured = [(run, r) for run, r in self.rows if r["status"] == "measured"]
        lines = []
        for titan, t in ((run, r) for run, r in measured if run.kind == "titan"):
            same = (titan.compile, titan.fp8, titan.llama3)
            for run, r in measured:
                if run.kind == "ours" and (run.compile, run.fp8, run.llama3) == same:
                    ratio = r["step_s"] / t["step_s"]
                    lines.append(f"{run.name} / {titan.name}: {ratio:.3f}")
        notes = {r["note"] for run, r in measured if run.kind == "titan" and r.get("note")}
        return lines + sorted(notes)

    def markdown(self) -> str:
        header = ["run", "step ms", "MFU 6N+12Lhs", "MFU 6N", "peak", "/ peer", "graph breaks"]
        header += ["wall s / est.", "planner ms (/ step)"]
        done = [self.cells(run, r) for run, r in self.rows if r["status"] == "measured"]
        lines = [table(header, done), "", *self.against_torchtitan()]
        why: dict[tuple[str, str], list[str]] = {}  # one line per reason
        for run, r in self.rows:
            if r["status"] != "measured":
                why.setdefault((r["status"], r["reason"]), []).append(run.name)
        lines += [
            f"{status}: {', '.join(names)}: {reason}" for (status, reason), names in why.items()
        ]
        return "\n".join(lines)


def skip_reason(a: argparse.Namespace, run: Run, need: float, left: float, fp8: str, rows) -> str:
    """Why `run` does not start ("" when it does): torchtitan or FP8 unavailable (`fp8`), an
    earlier torchtitan row failed (the next would fail alike, at the cost of the rows after
    it), its shape's own run without a result (a peer with nothing to compare), or `need`
    seconds over `left`."""
    if run.kind == "titan":
        if a.precision != "bf16":
            return f"torchtitan rows train in bf16 (its mixed precision), not {a.precision}"
        if why := torchtitan_peer.unavailable():
            return why
        if any(r.kind == "titan" and m["status"] == "failed" for r, m in rows):
            return "an earlier torchtitan row failed (its reason is above)"
    if run.fp8 != "none" and fp8:
        return fp8
    if need > left:
        return f"estimated {need:.0f} s > {max(left, 0):.0f} s left of --budget-s {a.budget_s:.0f}"
    mine = [m for r, m in rows if r.llama3 == run.llama3 and r.kind == "ours"]
    if run.llama3 and run.kind == "peer" and mine and mine[0]["status"] != "measured":
        return "its shape's shardwise run has no result to compare"
    return ""


def run_all(a: argparse.Namespace, root: Path, results: Results, flops: dict) -> None:
    """Every planned run in order, each skipped when its estimate no longer fits the budget."""
    from shardwise.distributed import device as dev

    start, prepared = time.monotonic(), False
    peak, fp8 = dev.detect().peak_flops(a.precision), fp8_unavailable(a.smoke)
    runs = plan_runs(a)
    for i, run in enumerate(runs):
        est = estimate_s(a, run, flops[run.llama3], peak)
        if run.kind == "ours" and not prepared and peak:
            est += ESTIMATE["prepare_s"]  # the first `train` prepares the data
        need = est  # the Llama-3 shape's eager run goes only with time for its peer (the ratio)
        if run.llama3 and run.kind == "ours" and run.compile == "false":
            later = [r for r in runs[i + 1 :] if r.llama3 and r.kind == "peer"]
            need += sum(estimate_s(a, r, flops[True], peak) for r in later)
        left = a.budget_s - (time.monotonic() - start)
        why = skip_reason(a, run, need, left, fp8, results.rows)
        if why:
            results.add(run, {"status": "skipped", "reason": why})
            continue
        print(f"== {run.name}: estimated {est:.0f} s, {left:.0f} s left", flush=True)
        t0 = time.monotonic()
        # a torchtitan row (never run on this machine before, maybe) gets twice its estimate:
        # a stall there must not cost the rows after it
        cap = left + 30 if run.kind != "titan" else min(left + 30, 2 * est + 30)
        r = measure(a, run, root / f"run{i}", timeout=cap)
        r.update(wall_s=time.monotonic() - t0, estimate_s=est)
        prepared = prepared or run.kind == "ours"
        print(f"== {run.name}: {r['status']} in {r['wall_s']:.0f} s", flush=True)
        results.add(run, r)


def _planned(r: dict) -> str:
    """The planner's step for a row and its ratio to the row's measured step ("-": none)."""
    plan = r.get("plan_s")
    return f"{plan * 1e3:.1f} ({plan / r['step_s']:.2f})" if plan else "-"


def publish(a: argparse.Namespace, results: Results) -> None:
    """`--row FILE`: each measured run of the preset as a published row (the Llama-3 shape
    is no preset, so its rows are not); a compiled or FP8 run's layout says so (`compile`,
    `float8`, as the record's other sources write it) and its id is suffixed with it."""
    from shardwise.distributed import device as dev

    device = dev.detect().name
    for run, r in results.rows:
        if run.kind != "ours" or run.llama3 or r["status"] != "measured":
            continue
        cells = results.cells(run, r)[:7]
        row = published_row(a, r["step_s"], r["mfu"], r["peak_bytes"], device, cells)
        row["source"] = row["source"].replace("cuda_profile.py", f"cuda_speed.py ({run.name})")
        if run.compile != "false":  # each row says what it ran, under an id of its own
            row["id"] += "-compiled"
            row["layout"]["compile"] = True
        if run.fp8 != "none":
            row["id"] += f"-fp8{run.fp8}"
            row["layout"]["float8"] = run.fp8
        with a.row.open("a") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"published row {row['id']} ({run.name}) appended to {a.row}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, warmup=3)  # the first steps compile
    p.add_argument("--llama3-layers", type=int, default=8, help="a trimmed Llama-3-8B shape")
    p.add_argument("--budget-s", type=float, default=480, help="skip runs that would not fit")
    p.add_argument("--out", type=Path, help="write each run here as it is measured")
    p.add_argument("--row", type=Path, help="append each shardwise run as a published row")
    add_smoke(p)
    a = p.parse_args()
    if a.smoke:
        a.model, a.seq, a.micro, a.global_batch, a.steps, a.warmup = "tiny", 64, 2, 4, 2, 1
        a.llama3_layers = min(a.llama3_layers, 1)
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/cuda_speed.py needs a CUDA device (or --smoke).")
    preamble()
    out = a.out or Path(tempfile.mkdtemp(prefix="cuda-speed-"))  # kept: the results
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_speed.jsonl").write_text("")  # this run's rows only
    with tempfile.TemporaryDirectory(prefix="cuda-speed-runs-") as scratch:  # runs' folders
        root = Path(scratch)
        facts = {s: shape_facts(a, root, s) for s in {False, bool(a.llama3_layers)}}
        results = Results(out, {s: f[0] for s, f in facts.items()}, [])
        run_all(a, root, results, {s: f[1] for s, f in facts.items()})
    share = results.shares[False]
    print(f"model {a.model}, seq {a.seq}, micro {a.micro}, global batch {a.global_batch}, "
          f"{a.precision}; attention {share:.1%} of the 6N+12Lhs FLOPs")  # fmt: skip
    print(results.markdown())
    print(f"rows: {out / 'cuda_speed.jsonl'}, table: {out / 'cuda_speed.md'}")
    if a.row:
        publish(a, results)
    return 1 if any(r["status"] == "failed" for _, r in results.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
