"""Compiled blocks (`train.compile=blocks`) against the eager engine, side by side in one run.

One process, the same model and batch; rounds alternate (eager, compiled, compiled, eager,
...) so drift hits both alike. Per engine: the median over rounds of the median steady step
(the first WARMUP_STEPS steps, which pay the compilation, left out), the first step (what
compiling costs once), and the ratio compiled / eager (< 1: compiling is faster). On a CPU
TorchInductor generates C++/OpenMP kernels; a speed-up here is welcome, not the point: the
device numbers come from a GPU run.

    .venv/bin/python benchmarks/compile_speed.py [--sizes tiny,100m] [--rounds 2] [--steps 10]
"""

from __future__ import annotations

import argparse

from common import (
    WARMUP_STEPS,
    add_smoke,
    check,
    engine_rounds,
    engine_times,
    median,
    preamble,
    table,
)
from shardwise.launchers.harness import run_world

SIZES = {  # ~100m: the 125m preset (GPT-2 small's shape) with our Llama-style blocks
    "tiny": ["--model.name=tiny"],
    "100m": ["--model.name=125m", "--model.n_layers=8"],
}
ENGINES = [("eager", [], None), ("compiled", ["--train.compile=blocks"], None)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,100m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=WARMUP_STEPS + 5)
    add_smoke(ap)
    args = ap.parse_args()
    sizes, rounds, steps = args.sizes.split(","), args.rounds, args.steps
    if args.smoke:
        sizes, rounds, steps = ["tiny"], 1, 2
    preamble()
    rows = []
    for size in sizes:
        base = [
            *SIZES[size],
            f"--train.steps={steps}",
            "--train.global_batch=4",
            "--data.seq_len=128",
            "--train.eval_every=0",
            "--train.eval_batches=0",
        ]
        cases, keys = engine_rounds(ENGINES, base, rounds)
        results = run_world(1, cases)
        check(results)
        by_key = dict(zip(keys, results, strict=True))  # per case: its ranks' results
        times = engine_times(by_key, [e[0] for e in ENGINES], rounds)
        first = {
            name: median([by_key[name, r][0]["records"][0]["step_time_s"] for r in range(rounds)])
            for name, _, _ in ENGINES
        }
        graphs = by_key["compiled", 0][0]["records"][0]["compile"]
        for name, _, _ in ENGINES:
            rows.append([size, name, f"{times[name] * 1000:.1f}", f"{first[name]:.2f}", ""])
        ratio = times["compiled"] / times["eager"]
        rows.append([size, "compiled / eager", f"{ratio:.3f}", "", str(graphs["graph_breaks"])])
    print(table(["model", "engine", "steady step ms", "first step s", "graph breaks"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
