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
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import timeit
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
    print(f"load average at the end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
