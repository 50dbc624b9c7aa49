"""One GPU: `shardwise profile` of a bf16 decoder beside the planner and plain PyTorch AMP.

What it measures: on one CUDA device, `shardwise profile` of a
decoder (default the 1b preset, seq 2048, bf16) exactly as a user runs it; printed: the host
ledger of the measured steps, the device's ledger of the traced step (from its CUDA kernels,
profile/kernels.py), the MFU, the allocator's peak (`max_memory_allocated`) and the planner's
prediction for the same config on the detected hardware (`shardwise explain --json`). Then,
in this process, the peer: the same model (same module, init, data order) trained by a plain
PyTorch loop with `torch.autocast(bf16)` over fp32 parameters and fused AdamW, the standard
recipe; its median step, MFU and peak beside ours, with the ratio ours / peer.
`--ledger-rounds R` then measures the always-on ledger's cost (`log.ledger`) on the device:
`shardwise train` of a small decoder (125m, seq 1024, one micro-batch of 8: the most host
work per kernel, so the most exposed clock) with the ledger on and off, in alternating order
(on, off; off, on; ...), the median period between consecutive steps' ends (metrics'
`time`: bookkeeping and log line included) after 5 warm-up steps per run, and the ratio.
`--verify CAUSE` (data_wait: a 40 ms sleep per micro-batch load, the profile tests' hook;
recompute: memory.recompute=full) profiles the decoder with that cause injected, then with
its finding's remedy, and prints predicted against measured gain (`shardwise profile
--verify-remedy`). `--ledger-only` skips the profile. `--smoke` runs the tiny preset a few
steps on whatever device there is (CPU here). `--row FILE` appends the measured run to FILE
as a row of the published record (the format of benchmarks/published/shardwise.jsonl, which
the planner calibrates on): copy it there to make the run a calibration row.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from common import add_smoke, preamble, table

CLI = "import sys; from shardwise.cli.main import main; sys.exit(main())"


def overrides(a: argparse.Namespace, folder: Path) -> list[str]:
    return [
        f"--model.name={a.model}",
        f"--data.seq_len={a.seq}",
        f"--train.global_batch={a.global_batch}",
        f"--train.micro_batch={a.micro}",
        f"--precision.compute={a.precision}",
        "--train.eval_batches=0",
        f"--run.dir={folder}",
    ]


def shardwise(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"shardwise {args[0]} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc


def stream(
    args: list[str], timeout: float | None = None, program: Sequence[str] = ("-c", CLI)
) -> tuple[int, str]:
    """`shardwise ARGS` (or another `program` of this Python's) with its output passed on line
    by line as it comes (a GPU machine's caller sees progress, and a timeout keeps what was
    printed); (exit status, last lines). Past `timeout` seconds the run is killed (exit -9)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, *program, *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    timer = threading.Timer(timeout, proc.kill) if timeout else None
    if timer:
        timer.start()
    tail: collections.deque[str] = collections.deque(maxlen=6)
    for line in proc.stdout:
        print(f"  {line}", end="", flush=True)
        tail.append(line.rstrip())
    rc = proc.wait()
    if timer:
        timer.cancel()
    return rc, " / ".join(tail)


def ours(a: argparse.Namespace, folder: Path) -> tuple[dict, list[dict]]:
    """The profile's summary and its metrics records (what it printed is passed on)."""
    steps = [f"--steps={a.steps}", f"--profile.warmup={a.warmup}", "--log.every=1"]
    rc, tail = stream(["profile", *overrides(a, folder), "--nproc=1", *steps])
    if rc:
        sys.exit(f"shardwise profile failed ({rc}): {tail}")
    out = folder / "profile"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), records


def predicted(a: argparse.Namespace, folder: Path) -> dict:
    proc = shardwise(["explain", *overrides(a, folder), "--nproc=1", "--json"])
    return json.loads(proc.stdout)


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The peer's loss: the sum of token cross-entropies over fp32 logits."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum")


def peer(
    a: argparse.Namespace,
    folder: Path,
    n_steps: int,
    extra: Sequence[str] = (),
    build: Callable | None = None,
    compile_loss: bool = False,
    amp: bool = True,
) -> dict:
    """Plain PyTorch AMP on the same model (`extra`: overrides of its shape), data order and
    AdamW settings. `build(spec, seq, device)`: another implementation of the model (another
    framework's, at the same widths), which must hold the same parameter count; `compile_loss`:
    the loss compiled (as torchtitan's trainer does with its blocks compiled); `amp=False`: no
    autocast (a model whose own wrapping computes in bf16: torchtitan's FSDP2 policy)."""
    from shardwise.config import load_config
    from shardwise.data import GlobalSampler, load_data, split_for_rank
    from shardwise.distributed import device as dev
    from shardwise.models import build_model, init_weights
    from shardwise.training.metrics import flops_per_token
    from shardwise.training.runtime import data_spec
    from shardwise.training.validate import derive

    cfg = load_config(None, [*overrides(a, folder), *extra])
    d = derive(cfg, 1)
    info = dev.detect(cfg.run.device)
    data = load_data(data_spec(cfg, d.spec.vocab_size), "train")
    with torch.device("meta"):  # ours, shapes only: the parameter count and FLOPs
        shape = build_model(d.spec)
    if build is None:
        with torch.device(info.device):
            model = build_model(d.spec)
        init_weights(model, cfg.train.seed)
    else:
        torch.manual_seed(cfg.train.seed)
        model = build(d.spec, d.tokens_per_sample, info.device)
        want = sum(p.numel() for p in shape.parameters())
        have = sum(p.numel() for p in model.parameters())
        if have != want:
            raise ValueError(f"the peer's model holds {have:,} parameters, ours {want:,}")
    loss_fn = torch.compile(summed_loss) if compile_loss else summed_loss
    fused = info.type == "cuda"
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, weight_decay=cfg.optim.weight_decay, fused=fused
    )
    sampler = GlobalSampler(len(data), cfg.train.global_batch, cfg.train.seed)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.compute)
    count = cfg.train.global_batch * d.tokens_per_sample
    times = []
    dev.reset_peak_memory(info)
    for step in range(n_steps):
        t0 = time.perf_counter()
        for micro in split_for_rank(sampler.global_indices(step), 0, 1, d.micro_batch):
            x, y = (t.to(info.device) for t in data.get_batch(micro))
            with torch.autocast(
                info.type, dtype=dtype or torch.float32, enabled=amp and bool(dtype)
            ):
                logits = model(x)
            loss = loss_fn(logits, y)
            (loss / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dev.synchronize(info)
        times.append(time.perf_counter() - t0)
    flops = flops_per_token(shape, d) * d.tokens_per_step
    step = statistics.median(times[a.warmup :])
    peak = info.peak_flops(cfg.precision.compute)
    return {
        "step_s": step,
        "mfu": flops / step / peak if peak else None,
        "peak_bytes": dev.peak_memory(info),
        "device": info.name,
    }


def ledger_cost(a: argparse.Namespace, folder: Path) -> None:
    """`shardwise train` with `log.ledger` on and off, alternating; median steps, ratios."""
    model, seq = ("tiny", 64) if a.smoke else ("125m", 1024)
    base = [
        f"--model.name={model}",
        f"--data.seq_len={seq}",
        "--train.global_batch=8",
        f"--precision.compute={a.precision}",
        f"--train.steps={a.ledger_steps}",
        "--train.eval_batches=0",
        "--log.tensorboard=false",
        "--nproc=1",
    ]
    print(f"ledger cost: shardwise train {' '.join(base)} --log.ledger=true|false")
    medians: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(a.ledger_rounds):
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            run = folder / f"ledger-{side}-{r}"
            flag = f"--log.ledger={'true' if side == 'on' else 'false'}"
            shardwise(["train", *base, flag, f"--run.dir={run}"])
            lines = (run / "metrics.jsonl").read_text().splitlines()
            ended = [json.loads(line)["time"] for line in lines][5:]
            # the whole period from one step's end to the next: the ledger's bookkeeping and
            # the log line included (step_time_s stops at the optimizer's sync)
            medians[side].append(statistics.median(b - a for a, b in itertools.pairwise(ended)))
    rows = [
        [f"round {r + 1}", f"{on * 1e3:.2f}", f"{off * 1e3:.2f}", f"{on / off:.4f}"]
        for r, (on, off) in enumerate(zip(medians["on"], medians["off"], strict=True))
    ]
    print(table(["round", "ledger on ms", "ledger off ms", "on / off"], rows))
    on, off = statistics.median(medians["on"]), statistics.median(medians["off"])
    print(f"ledger on / off (medians over rounds): {on / off:.4f} (bar: <= 1.02)")


def verify_cause(a: argparse.Namespace, folder: Path) -> None:
    """`--verify-remedy` of the injected cause's finding (the hook needs this process)."""
    from shardwise.cli.profile import verify
    from shardwise.config import load_config

    extra = ["--memory.recompute=full"] if a.verify == "recompute" else []
    hook = "support.hooks:slow_data" if a.verify == "data_wait" else None
    cfg = load_config(None, [*overrides(a, folder), *extra, f"--profile.warmup={a.warmup}"])
    verify(cfg, 1, folder / "profile", a.steps, 1, hook=hook, cause=a.verify)


def published_row(
    a: argparse.Namespace, step: float, mfu: float | None, peak: int | None, device: str, cells
) -> dict:
    """This run as a row of the published record (benchmarks/published_rows._shardwise reads
    it): the catalog's name for the card, the layout, the measured step and peak allocation."""
    import datetime

    from shardwise.plan.hardware import detect_hardware

    gpu = detect_hardware().name if torch.cuda.is_available() else "cpu"
    shape = f"model {a.model}, seq {a.seq}, micro {a.micro}, global batch {a.global_batch}"
    return {
        "id": f"shardwise-{gpu}-{a.model}-1g-s{a.seq}-mb{a.micro}",
        "source": f"shardwise's own run: benchmarks/cuda_profile.py on one {device}, torch "
        f"{torch.__version__}, {datetime.date.today()}",
        "quote": f"device: {device}; {shape}, {a.precision} || | {' | '.join(cells)} |",
        "model": {"name": a.model, "preset": a.model, "seq_len": a.seq},
        "hardware": {"gpu": gpu, "n_gpus": 1, "per_node": 1, "network": None},
        "layout": {
            "tp": 1,
            "pp": 1,
            "dp": 1,
            "sharding": "none",
            "sp": False,
            "recompute": "none",
            "micro_batch": a.micro,
            "global_batch": a.global_batch,
        },
        "precision": a.precision,
        "measured": {
            "step_time_s": step,
            "mem_gib_per_gpu": peak / 2**30 if peak else None,
            "mem_counts": "allocated",
            "mfu": mfu,
        },
        "flop_convention": "6N + 12·L·h·s per token (shardwise's `mfu`), the catalog's dense "
        f"{a.precision} peak",
        "assumed": {
            "memory": "torch.cuda.max_memory_allocated (the allocator's peak allocation), not "
            "a whole device's use"
        },
        "notes": f"The median of {a.steps} steps after {a.warmup} warm-up steps "
        "(benchmarks/cuda_profile.py --row). A calibration row for its card's chip "
        "(published_rows.calibration) once in benchmarks/published/shardwise.jsonl.",
    }


def _pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x else "-"


def _gb(x: float | None) -> str:
    return f"{x / 2**30:.2f} GiB" if x else "-"


def add_run_args(p: argparse.ArgumentParser, warmup: int) -> None:
    """The decoder, batch and step counts of a one-GPU run (this script and cuda_speed.py)."""
    p.add_argument("--model", default="1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=5, help="measured steps")
    p.add_argument("--warmup", type=int, default=warmup, help="steps left out")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, warmup=2)
    p.add_argument(
        "--ledger-rounds", type=int, help="rounds of the ledger A/B (default 0; 2 in smoke)"
    )
    p.add_argument("--ledger-steps", type=int, default=30, help="steps per ledger run")
    p.add_argument("--ledger-only", action="store_true", help="skip the profile and the peer")
    p.add_argument("--verify", choices=["data_wait", "recompute"], help="inject, then remedy")
    p.add_argument("--row", type=Path, help="append the run to FILE as a published row")
    add_smoke(p)
    a = p.parse_args()
    if a.smoke:
        a.model, a.seq, a.micro, a.global_batch, a.steps, a.warmup = "tiny", 64, 2, 4, 2, 1
        a.ledger_steps = 7
        a.ledger_rounds = 2 if a.ledger_rounds is None else a.ledger_rounds
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/cuda_profile.py needs a CUDA device (or --smoke).")
    a.ledger_rounds = a.ledger_rounds or 0
    preamble()
    with tempfile.TemporaryDirectory(prefix="cuda-profile-") as scratch:  # runs' folders
        folder = Path(scratch)
        if a.verify:
            verify_cause(a, folder)
        elif not a.ledger_only:
            profile_and_peer(a, folder)
        if a.ledger_rounds:
            ledger_cost(a, folder)
    return 0


def profile_and_peer(a: argparse.Namespace, folder: Path) -> None:
    summary, records = ours(a, folder)
    plan = predicted(a, folder / "explain")
    measured = [r for r in records if r["step"] > a.warmup][: a.steps]
    step = statistics.median(r["step_time_s"] for r in measured)
    peak = max(r["mem_bytes"].get("device_peak", 0) for r in measured) or None
    them = peer(a, folder / "peer", a.warmup + a.steps)
    print(f"device: {them['device']}; model {a.model}, seq {a.seq}, micro {a.micro}, "
          f"global batch {a.global_batch}, {a.precision}")  # fmt: skip
    rows = [
        ["shardwise (measured)", f"{step * 1e3:.1f}", _pct(summary.get("mfu")), _gb(peak)],
        [
            "planner (explain)",
            f"{plan['step_time_s'] * 1e3:.1f}",
            _pct(plan.get("mfu")),
            _gb(plan["mem_bytes"]["total"]),
        ],
        [
            "PyTorch AMP (peer)",
            f"{them['step_s'] * 1e3:.1f}",
            _pct(them["mfu"]),
            _gb(them["peak_bytes"]),
        ],
    ]
    print(table(["run", "step ms", "MFU", "peak memory"], rows))
    if a.row:
        row = published_row(a, step, summary.get("mfu"), peak, them["device"], rows[0])
        with a.row.open("a") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"published row {row['id']} appended to {a.row}")
    print(f"ours / peer step time: {step / them['step_s']:.3f}")
    print(f"planner / measured step time: {plan['step_time_s'] / step:.3f}")
    if peak:
        print(f"planner / measured peak memory: {plan['mem_bytes']['total'] / peak:.3f}")
    for r in summary["ranks"]:
        if r.get("device_ledger"):
            print("device ledger (traced step):", json.dumps(r["device_ledger"]))


if __name__ == "__main__":
    sys.exit(main())
