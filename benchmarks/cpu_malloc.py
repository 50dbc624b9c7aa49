"""CPU step time with freed memory kept in the heap (ours, device.keep_freed_memory) against
glibc's default (SHARDWISE_MALLOC=default), side by side.

Each round runs `shardwise train` on one CPU rank twice, once each way, in alternating order;
per run the median step time after warm-up and the process's minor page faults. Prints the
medians over rounds and the ratio ours / default.

    .venv/bin/python benchmarks/cpu_malloc.py [--rounds 3] [--layers 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from common import add_smoke, command_line, commit, load, median, steady, table


def one(layers: int, seq: int, steps: int, default: bool) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("SHARDWISE_MALLOC", None)
    if default:
        env["SHARDWISE_MALLOC"] = "default"
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "shardwise.cli.main", "train", f"--model.n_layers={layers}"]
        cmd += [f"--data.seq_len={seq}", "--train.global_batch=8", f"--train.steps={steps}"]
        cmd += ["--train.eval_every=0", "--log.progress=off", f"--run.dir={d}"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
        lines = Path(d, "metrics.jsonl").read_text().splitlines()
        times = [json.loads(x)["step_time_s"] for x in lines]
    return median(steady(times)), faults


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.layers, args.seq, args.steps = 1, 1, 32, 2
    print(f"shardwise commit {commit()}\n$ {command_line()}\nload at the start: {load()}")
    got: dict[str, list[tuple[float, int]]] = {"ours": [], "glibc default": []}
    for i in range(args.rounds):
        order = [False, True] if i % 2 == 0 else [True, False]
        for default in order:
            got["glibc default" if default else "ours"].append(
                one(args.layers, args.seq, args.steps, default)
            )
    rows = []
    for name, runs in got.items():
        rows.append(
            [
                name,
                f"{1000 * median([t for t, _ in runs]):.1f}",
                " / ".join(f"{1000 * t:.0f}" for t, _ in runs),
                f"{median([f for _, f in runs]):,.0f}",
            ]
        )
    print(table(["malloc", "step ms (median)", "per round", "minor faults/run"], rows))
    ratio = median([t for t, _ in got["ours"]]) / median([t for t, _ in got["glibc default"]])
    print(f"ours / default step time: {ratio:.3f}\nload at the end: {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
