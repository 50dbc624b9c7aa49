"""Scenario 2 of docs/design.md at CPU scale: a GPT-style decoder trained at every ZeRO stage, with
and without optimizer offload, in one spawned world of 2 ranks. Prints memory per rank by
category (device and host), median step time, dp bytes per step and the final loss.

    .venv/bin/python benchmarks/zero_stages.py [--steps 20] [--nproc 2]
"""

from __future__ import annotations

import argparse

from common import add_smoke, command_line, load, mb, median, steady, table
from shardwise.launchers.harness import run_world

LAYOUTS = [
    ("DDP (zero 0)", ["--parallel.zero=0"]),
    ("ZeRO-1", ["--parallel.zero=1"]),
    ("ZeRO-2", ["--parallel.zero=2"]),
    ("ZeRO-3", ["--parallel.zero=3"]),
    ("ZeRO-1 + offload", ["--parallel.zero=1", "--memory.offload=optimizer"]),
    ("ZeRO-2 + offload", ["--parallel.zero=2", "--memory.offload=optimizer"]),
    ("ZeRO-3 + offload", ["--parallel.zero=3", "--memory.offload=optimizer"]),
    ("ZeRO-3 + offload params", ["--parallel.zero=3", "--memory.offload=optimizer+params"]),
]
DEVICE = ("params", "grads", "master", "optimizer", "buffers", "activations", "total")
HOST = ("host_params", "host_master", "host_optimizer")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    add_smoke(ap)
    args = ap.parse_args()
    args.steps = 2 if args.smoke else args.steps
    print("command:", command_line())
    print(f"load before: {load()}")
    # GPT-2 style (LayerNorm, learned positions, GELU, tied embeddings), bf16 compute and
    # gradients with fp32 masters: the setting of the ZeRO paper's 16 bytes per parameter.
    base = [
        "--model.name=gpt2-tiny",
        "--model.n_layers=4",
        "--data.seq_len=128",
        "--train.global_batch=8",
        f"--train.steps={args.steps}",
        "--train.eval_batches=0",
        "--precision.compute=bf16",
        "--precision.reduce=bf16",
        "--log.every=1000000",
    ]
    cases = [{"overrides": [*base, *extra]} for _, extra in LAYOUTS]
    results = run_world(args.nproc, cases)
    rows = []
    ddp_states = None
    for (name, _), per_rank in zip(LAYOUTS, results, strict=True):
        res = per_rank[0]
        if "error" in res:
            raise SystemExit(f"{name}: {res['error']}")
        mem = res["records"][-1]["mem_bytes"]
        states = sum(mem.get(k, 0) for k in ("params", "grads", "master", "optimizer"))
        ddp_states = ddp_states or states
        t = median(steady([r["step_time_s"] for r in res["records"]]))
        rows.append(
            [
                name,
                *(mb(mem.get(k, 0)) for k in DEVICE),
                *(mb(mem.get(k, 0)) for k in HOST),
                f"{states / ddp_states:.3f}",
                f"{1000 * t:.0f}",
                mb(res["records"][-1]["comm_bytes"]["dp"]),
                f"{res['losses'][-1]:.4f}",
            ]
        )
    print(f"\n{args.nproc} ranks, MB per rank (max over ranks), device then host:\n")
    print(
        table(
            ["layout", *DEVICE, *HOST, "device states/DDP", "step ms", "dp MB/step", "final loss"],
            rows,
        )
    )
    print(f"\nload after: {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
