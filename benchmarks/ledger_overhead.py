"""The always-on step ledger (`log.ledger`, on by default): its cost in `train`, side by side.

What it measures: in ONE spawned world of 2 gloo ranks, in alternating rounds, the same job
with the ledger on and off: a decoder (2 blocks, 128 wide, seq_len 64, dp2) under ZeRO-0 and
under ZeRO-3 (every block gathered and scattered each micro-batch: the most timed collectives
per step, so the most clock calls). Printed: per case the median steady step time (slowest
rank) of each round, on and off, and the ratio on / off per round and overall (as noisy as
this 2-core machine: several percent from round to round); then the clock's cost counted
exactly: regions entered per step (one process running the same case) plus collectives per
step (from the 2-rank records), times one region's measured cost, as a share of the step.
The bar: <= 2 %.

Then the profiler's host-sync counter (`profile.host_syncs`, profile/host_syncs.py: it wraps
torch's reading entry points during the measured steps), in the same world: the zero0 case
as `shardwise profile` runs it, counted and not counted in alternating rounds; per round the
median measured step (the ledger's step_s, slowest rank; the traced step left out) and the
training threads' CPU time per step; then the counter's cost counted: calls through its
wrappers per step (one process) times one wrapped call's added cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import timeit
from pathlib import Path
from statistics import median

from common import (
    add_smoke,
    check,
    load,
    preamble,
    round_medians,
    table,
)
from shardwise.distributed.clock import clock
from shardwise.launchers.harness import run_here, run_world

NPROC = 2
SIDES = ("on", "off")
SYNC_SIDES = ("counted", "not counted")
PROFILE_WARMUP = 3


def overrides(steps: int, smoke: bool) -> list[str]:
    return [
        "--model.n_layers=2",
        f"--model.dim={64 if smoke else 128}",
        "--model.n_heads=4",
        "--model.n_kv_heads=4",
        "--model.vocab_size=2048",
        "--data.seq_len=64",
        "--train.global_batch=8",
        "--train.micro_batch=2",
        f"--train.steps={steps}",
        "--train.eval_every=0",
        "--train.eval_batches=0",
    ]


CASES = {"zero0": [], "zero3": ["--parallel.zero=3"]}


def _entry_cost() -> float:
    """Seconds one region entry and exit costs (the clock on), best of 5 x 20,000."""
    from shardwise.distributed.clock import Clock

    c = Clock()

    def region():
        with c.phase("x"):
            pass

    return min(timeit.repeat(region, number=20_000, repeat=5)) / 20_000


def _profile_cases(base: list[str], steps: int, rounds: int, root: str):
    """The zero0 case as a profile (warm-up, `steps` measured, one traced), the host-sync
    counter on and off in alternating rounds."""
    cases, keys = [], []
    for r in range(rounds):
        for side in SYNC_SIDES if r % 2 == 0 else SYNC_SIDES[::-1]:
            run_dir = Path(root, f"{side.replace(' ', '-')}-{r}")
            cases.append(
                {
                    "overrides": [
                        *base,
                        f"--profile.steps={steps}",
                        f"--profile.warmup={PROFILE_WARMUP}",
                        f"--train.steps={PROFILE_WARMUP + steps + 1}",
                        f"--profile.host_syncs={'true' if side == 'counted' else 'false'}",
                        f"--run.dir={run_dir}",
                    ]
                }
            )
            keys.append((side, r, run_dir))
    return cases, keys


def _measured_s(per_rank: list[dict]) -> float:
    """The median measured step of a profile: per step the slowest rank's ledger step_s."""
    steps = [[x["ledger"]["step_s"] for x in r["records"][PROFILE_WARMUP:-1]] for r in per_rank]
    return median(max(s) for s in zip(*steps, strict=True))


def _call_cost() -> float:
    """Seconds the counter adds to one call it wraps (a slice, `__getitem__`: the most
    frequent), best of 5 x 20,000."""
    import torch

    from shardwise.profile.host_syncs import HostSyncs

    a = torch.ones(4)

    def calls():
        a[1:3]

    bare = min(timeit.repeat(calls, number=20_000, repeat=5))
    with HostSyncs():
        counted = min(timeit.repeat(calls, number=20_000, repeat=5))
    return max(0.0, counted - bare) / 20_000


def _wrapped_per_step(base: list[str]) -> float:
    """Calls through the counter's wrappers per step of `base`, counted in one process: the
    difference of a 6-step and a 2-step run (what building the model calls cancels), over 4."""
    from shardwise.profile.host_syncs import HostSyncs

    class Calls(HostSyncs):
        n = 0

        def _wrap(self, original, test):
            inner = super()._wrap(original, test)

            def call(*args, **kwargs):
                Calls.n += 1
                return inner(*args, **kwargs)

            return call

    counts = []
    for steps in (2, 6):
        with tempfile.TemporaryDirectory(prefix="syncs-bench-") as tmp, Calls():
            before = Calls.n
            run_here({"overrides": [*base, f"--train.steps={steps}", f"--run.dir={tmp}"]}, tmp)
            counts.append(Calls.n - before)
    return (counts[1] - counts[0]) / 4


def _thread_cpu_s(run_dir: Path) -> float:
    """The training threads' median CPU seconds per measured step (mean over the ranks; from
    the capture's `cpu`, profile/cpu.py): what the rank computed, less sensitive than wall
    time to the other load of a shared machine."""
    per_rank = []
    for rank in range(NPROC):
        part = json.loads((run_dir / f"rank{rank}.json").read_text())
        per_rank.append(median(s["cpu"]["thread_cpu_s"] for s in part["steps"]))
    return sum(per_rank) / NPROC


def host_syncs_part(base: list[str], steps: int, rounds: int) -> None:
    """The profiler's step with and without the host-sync counter, side by side."""
    meds: dict[str, list[float]] = {s: [0.0] * rounds for s in SYNC_SIDES}
    cpu: dict[str, list[float]] = {s: [0.0] * rounds for s in SYNC_SIDES}
    with tempfile.TemporaryDirectory(prefix="syncs-bench-") as root:
        cases, keys = _profile_cases(base, steps, rounds, root)
        results = run_world(NPROC, cases)
        check(results)
        for (side, r, run_dir), res in zip(keys, results, strict=True):
            part = json.loads((run_dir / "rank0.json").read_text())
            assert ("host_syncs" in part["steps"][0]) == (side == "counted"), (side, r)
            meds[side][r], cpu[side][r] = _measured_s(res), _thread_cpu_s(run_dir)
    rows = []
    for label, values in (("step", meds), ("thread CPU", cpu)):
        paired = [a / b for a, b in zip(values["counted"], values["not counted"], strict=True)]
        rows += [
            [f"{label} {side}", *(f"{m * 1e3:.1f}" for m in values[side])] for side in SYNC_SIDES
        ]
        rows.append([f"{label} counted / not", *(f"{x:.3f}" for x in paired)])
        print(f"host-sync counter, {label}: median counted / not counted {median(paired):.3f}")
    print(table(["profile zero0", *(f"round {r + 1} ms" for r in range(rounds))], rows))
    calls, cost = _wrapped_per_step(base), _call_cost()
    step = median(meds["not counted"])
    added = calls * cost
    print(
        f"host-sync counter counted: {calls:.0f} wrapped calls per step x {cost * 1e6:.2f} us = "
        f"{added * 1e6:.0f} us per step = {100 * added / step:.2f}% of a {step * 1e3:.1f} ms step"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each side (ABBA)")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.rounds = 2, 1
    preamble()
    base = overrides(args.steps, args.smoke)
    print(f"case: {' '.join(base)}")
    cases, keys = [], []
    for r in range(args.rounds):
        for size, extra in CASES.items():
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                flag = f"--log.ledger={'true' if side == 'on' else 'false'}"
                cases.append({"overrides": [*base, *extra, flag]})
                keys.append((size, side, r))
    results = run_world(NPROC, cases)
    check(results)
    by_key = dict(zip(keys, results, strict=True))
    for key, res in by_key.items():  # the flag did what it says
        has = "ledger" in res[0]["records"][-1]
        assert has == (key[1] == "on"), key
    rows, summary, meds = [], [], {}
    for size in CASES:
        med, _, paired, part = round_medians(by_key, size, SIDES, args.rounds, "on / off")
        meds[size] = med
        rows += part
        summary.append(
            [
                size,
                f"{median(med['on']) * 1e3:.1f}",
                f"{median(med['off']) * 1e3:.1f}",
                f"{median(paired):.3f}",
            ]
        )
    print(table(["case", "side", *(f"round {r + 1} ms" for r in range(args.rounds))], rows))
    print(table(["case", "ledger on ms", "ledger off ms", "median on / off"], summary))
    # the A/B ratio is as noisy as this machine; the clock's cost is also counted exactly:
    # regions entered per step (rank 0 of a 2-rank dp world enters the same ones as this one
    # process, plus its collectives' regions) x one entry's measured cost
    cost = _entry_cost()
    for size, extra in CASES.items():
        clk = clock()
        before = clk.entered
        with tempfile.TemporaryDirectory(prefix="ledger-bench-") as tmp:
            run_here({"overrides": [*base, *extra, "--log.ledger=true"]}, tmp)
        regions = (clk.entered - before) / args.steps
        res = by_key[size, "on", 0][0]["records"]
        calls = sum(res[-1]["comm_calls"].values()) + 3  # + loss, memory and norm all-reduces
        step = median(meds[size]["on"])
        added = (regions + calls) * cost
        print(
            f"{size}: {regions:.0f} regions + {calls} collectives per step x {cost * 1e6:.2f} us "
            f"= {added * 1e6:.0f} us per step = {100 * added / step:.3f}% of a {step * 1e3:.1f} ms "
            "step"
        )
    host_syncs_part(base, args.steps, args.rounds)
    print(f"load average at the end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
