"""Our ZeRO-1/2/3 against DeepSpeed ZeRO-1/2/3 and PyTorch FSDP2, side by side.

What it measures: on 2 gloo ranks in fp32, the same decoder, data order, seed, AdamW groups,
lr schedule and clipping are trained by shardwise (`--parallel.zero=1|2|3`), by DeepSpeed at
the same stage (`support.zero_peers:deepspeed_peer`: its defaults, except that its
ZeRO-3 runs our algorithm, every parameter sharded, freed after forward, gathered again for
backward; a second ZeRO-3 row runs DeepSpeed's own ZeRO-3 defaults) and, for ZeRO-3, by
FSDP2 (`fsdp2_peer`: `fully_shard` per block, then the root). All cases run in ONE spawned
world, in rounds whose order alternates, so that drift on a shared machine hits every engine
alike. Per case: the median step time over the steps after warm-up (max over ranks per
step); per engine: the median over rounds; the ratio ours/peer (target <= 1.00; hard limits
1.10 against DeepSpeed, 1.15 against FSDP2). The same ratio of process CPU time per step
(gloo threads included) is printed beside it: with other jobs on the machine, wall-clock
times inflate at random and CPU times much less.

Model-state bytes per rank come from each engine's own tensors (ours: `mem_bytes`; peers:
their parameter, gradient, fp32-partition and optimizer-state storages) beside the ZeRO
formulas: fp32 for the timed runs (no master copy; Adam's two moments K=8: ZeRO-1
4Ψ+4Ψ+8Ψ/N, ZeRO-2 4Ψ+12Ψ/N, ZeRO-3 16Ψ/N) and, from short extra runs, bf16 compute with fp32
masters (Rajbhandari et al. 2020, fig. 1: 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N). Bytes communicated per
step and rank, ring-equivalent (docs/design.md): ours from `comm_bytes["dp"]`, the peers' measured
by counting wrappers around `torch.distributed`'s collectives (`collectives.count_collectives`),
next to the formula 2(N-1)/N·4Ψ (ZeRO-1/2) or 3(N-1)/N·4Ψ (ZeRO-3).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import sys
import time

from common import WARMUP_STEPS, add_smoke, check, command_line, mb, median, steady, table
from shardwise.launchers.harness import run_world

NPROC = 2
PEERS = "support.zero_peers"
DS, FSDP2 = f"{PEERS}:deepspeed_peer", f"{PEERS}:fsdp2_peer"
DS_DEFAULTS = f"{PEERS}:deepspeed_default_peer"
SIZES = {  # name -> model overrides; every size measured is printed
    "L4 d256": ["--model.n_layers=4", "--model.dim=256"],
    "L8 d256": ["--model.n_layers=8", "--model.dim=256"],
}
LIMITS = {"DeepSpeed": 1.10, "DeepSpeed defaults": 1.10, "FSDP2": 1.15}
BF16 = ["--precision.compute=bf16", "--precision.reduce=bf16"]


def overrides(size: str, steps: int, stage: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "--model.name=tiny",
        *SIZES[size],
        "--data.seq_len=128",
        "--train.global_batch=8",
        f"--train.steps={steps}",
        "--train.lr=1e-3",
        "--train.seed=0",
        "--optim.warmup_steps=5",
        "--train.eval_every=0",
        "--train.eval_batches=0",
        "--precision.compute=fp32",
        f"--parallel.zero={stage}",
        *extra,
    ]


OURS = "zero_vs_peers:ours_timed"
# (engine, stage, peer) for every timed case
ENGINES = [
    ("ours", 1, OURS),
    ("DeepSpeed", 1, DS),
    ("ours", 2, OURS),
    ("DeepSpeed", 2, DS),
    ("ours", 3, OURS),
    ("DeepSpeed", 3, DS),
    ("DeepSpeed defaults", 3, DS_DEFAULTS),
    ("FSDP2", 3, FSDP2),
]


def available_engines() -> list[tuple[str, int, str]]:
    """ENGINES less DeepSpeed's rows where DeepSpeed is not installed (an optional extra)."""
    if importlib.util.find_spec("deepspeed") is not None:
        return ENGINES
    return [e for e in ENGINES if not e[0].startswith("DeepSpeed")]


def ours_timed(cfg) -> dict:
    """Our engine as the harness runs it (`run_job_here`: `build_run`, `fit`, gather), also
    taking each step's process CPU time, from `zero_grad` (the step's start) to the end of the
    optimizer step: with other jobs on the machine, wall-clock inflates more than CPU time
    does."""
    from shardwise.cli.verify import timed_fit
    from shardwise.job.prepare import run_job_here

    def body(run) -> dict:
        out = timed_fit(run)
        out["losses"] = [r["loss"] for r in out["records"]]
        out["params"] = run.reducer.full_parameters()
        return out

    return run_job_here(cfg, None, body)


def step_times(per_rank: list[dict], cpu: bool = False) -> list[float]:
    """Per step, the slowest rank (a step ends for the job when its last rank ends)."""
    if cpu:
        runs = [r["step_cpu_times"] for r in per_rank]
    elif "step_times" in per_rank[0]:  # a peer
        runs = [r["step_times"] for r in per_rank]
    else:
        runs = [[x["step_time_s"] for x in r["records"]] for r in per_rank]
    return [max(ts) for ts in zip(*runs, strict=True)]


def state_bytes(res: dict) -> dict[str, int]:
    """Model-state bytes by category, max over ranks."""
    keys = ("params", "grads", "master", "optimizer")
    if "records" in res[0]:  # ours: already the max over ranks
        mem = res[0]["records"][-1]["mem_bytes"]
        return {k: mem[k] for k in keys}
    return {k: max(r["state_bytes"].get(k, 0) for r in res) for k in keys}


def comm_bytes(res: dict) -> float:
    if "records" in res[0]:
        return median([x["comm_bytes"]["dp"] for x in res[0]["records"]])
    return res[0]["comm_bytes"]


def formula(stage: int, psi: int, n: int, bf16: bool) -> float:
    if bf16:  # 2-byte params and grads, fp32 master + 2 moments (K = 12)
        return {1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
    return {1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def load() -> str:
    """The machine's 1/5/15-minute load averages: other jobs inflate wall-clock times."""
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def fmt_states(s: dict[str, int]) -> str:
    total = sum(s.values())
    parts = "/".join(mb(s[k]) for k in ("params", "grads", "master", "optimizer"))
    return f"{mb(total)} ({parts})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25, help="steps per case (5 warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every engine")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES)[:1], choices=list(SIZES))
    parser.add_argument("--quick", action="store_true", help="first size, 1 round, 10 steps")
    add_smoke(parser)
    args = parser.parse_args()
    args.quick |= args.smoke
    sizes = list(SIZES)[:1] if args.quick else args.sizes
    steps = 2 if args.smoke else 10 if args.quick else args.steps
    rounds = 1 if args.quick else args.rounds
    engines = available_engines()
    print(f"$ {command_line()}")
    print(f"date: {datetime.date.today().isoformat()}; load average: {load()}")
    if len(engines) < len(ENGINES):
        print("DeepSpeed is not installed: its rows are skipped (pip install -e '.[bench]')")
    for size in sizes:
        print(f"{size}: {' '.join(overrides(size, steps, 0)[:-1])} --parallel.zero=1|2|3")
    print(
        f"{NPROC} ranks, gloo, 1 thread each, fp32; step time: median of steps "
        f"{WARMUP_STEPS + 1}..{steps}, max over ranks, then median over {rounds} rounds; "
        "round order alternates\n"
    )

    cases, keys = [], []
    for r in range(rounds):
        for size in sizes:
            for engine, stage, peer in engines if r % 2 == 0 else engines[::-1]:
                cases.append({"overrides": overrides(size, steps, stage), "peer": peer})
                keys.append((size, engine, stage, r))
    for size in sizes:  # bf16 compute, fp32 masters: model states only
        for engine, stage, peer in engines:
            cases.append({"overrides": overrides(size, 3, stage, tuple(BF16)), "peer": peer})
            keys.append((size, engine, stage, "bf16"))
    t0 = time.perf_counter()
    results = run_world(NPROC, cases)
    wall = time.perf_counter() - t0
    check(results)
    by_key = dict(zip(keys, results, strict=True))

    rows, per_round, mem_rows, worst = [], [], [], {}
    for size in sizes:
        med, cpu = {}, {}
        for engine, stage, _ in engines:
            runs = [by_key[size, engine, stage, r] for r in range(rounds)]
            meds = [median(steady(step_times(res))) for res in runs]
            med[engine, stage] = median(meds)
            cpu[engine, stage] = median([median(steady(step_times(res, True))) for res in runs])
            per_round.append([size, f"{engine} z{stage}", *(f"{m * 1000:.1f}" for m in meds)])
        first = by_key[size, "ours", 1, 0][0]
        psi = sum(p.numel() for p in first["params"].values())
        for engine, stage, _ in engines:
            if engine == "ours":
                continue
            ours, peer = by_key[size, "ours", stage, 0], by_key[size, engine, stage, 0]
            ratio = med["ours", stage] / med[engine, stage]
            worst[engine] = max(worst.get(engine, 0.0), ratio)
            dloss = max(
                abs(a - b) / abs(b)
                for a, b in zip(ours[0]["losses"], peer[0]["losses"], strict=True)
            )
            traffic = (3 if stage == 3 else 2) * (NPROC - 1) / NPROC * 4 * psi
            rows.append(
                [
                    size,
                    f"{psi / 1e6:.2f}M",
                    f"ZeRO-{stage}",
                    engine,
                    f"{med['ours', stage] * 1000:.1f}",
                    f"{med[engine, stage] * 1000:.1f}",
                    f"{ratio:.3f}",
                    f"{cpu['ours', stage] / cpu[engine, stage]:.3f}",
                    mb(comm_bytes(ours)),
                    mb(comm_bytes(peer)),
                    mb(traffic),
                    f"{dloss:.1e}",
                ]
            )
        for precision in ("fp32", "bf16"):
            bf16 = precision == "bf16"
            for engine, stage, _ in engines:
                if engine == "ours":
                    continue
                key = "bf16" if bf16 else 0
                ours = state_bytes(by_key[size, "ours", stage, key])
                peer = state_bytes(by_key[size, engine, stage, key])
                expect = formula(stage, psi, NPROC, bf16)
                mem_rows.append(
                    [
                        size,
                        precision,
                        f"ZeRO-{stage}",
                        mb(expect),
                        fmt_states(ours),
                        f"{sum(ours.values()) / expect:.3f}",
                        engine,
                        fmt_states(peer),
                        f"{sum(peer.values()) / expect:.3f}",
                    ]
                )

    print(
        table(
            [
                "size",
                "params",
                "stage",
                "peer",
                "ours ms",
                "peer ms",
                "time ours/peer",
                "CPU time ours/peer",
                "ours MB/step",
                "peer MB/step (measured)",
                "formula MB/step",
                "max rel dloss",
            ],
            rows,
        )
    )
    print("\nmodel states per rank, MB (params/grads/master/optimizer), max over ranks:")
    print(
        table(
            [
                "size",
                "compute",
                "stage",
                "formula MB",
                "ours MB",
                "ours/formula",
                "peer",
                "peer MB",
                "peer/formula",
            ],
            mem_rows,
        )
    )
    print("\nper-round median step time (ms); even rounds ran in the table's order, odd reversed:")
    print(table(["size", "engine", *(f"round {r + 1}" for r in range(rounds))], per_round))
    ds = [r for key, res in by_key.items() if key[1].startswith("DeepSpeed") for r in res[:1]]
    print(f"\nload average at the end: {load()}")
    if ds:
        print(
            f"DeepSpeed: first import {max(r['import_s'] for r in ds):.1f} s, "
            f"first initialize {max(r['init_s'] for r in ds):.1f} s; whole world {wall:.0f} s"
        )
    failed = False
    for engine, limit in LIMITS.items():
        if engine not in worst:
            continue
        w = worst[engine]
        verdict = "meets target" if w <= 1.0 else "within limit" if w <= limit else "TOO SLOW"
        failed |= w > limit
        print(f"worst time ratio vs {engine}: {w:.3f}: {verdict} (target <= 1.00, limit {limit})")
    return 1 if failed and not args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
