"""Context parallelism: the longest sequence cp = 1, 2, 4 trains within one activation budget
per rank, and the step time of ring vs Ulysses vs cp = 1 at a length all of them fit.

(a) For each cp, one sample a step (dp 1), one step at each power-of-two length from
--min-seq to --max-seq: a rank's saved activations (metrics.jsonl `mem_bytes.activations`,
the engine's own saved-tensor accounting, max over ranks), which grow with the length, against
--budget-mb; the longest within it is the answer. The planner's prediction (`explain`) is
printed beside each measured value. (b) At --time-seq, cp = 1 (one process), cp 2 and cp 4
with ring and Ulysses train --steps steps; ring and Ulysses run in the same world in --rounds
rounds whose order alternates (A B, B A). The median steady step (slowest rank per step), its
ratio to cp = 1 and ring / Ulysses are printed; one world per cp, so the ratios to cp = 1 also
carry the drift between worlds.

The model is the tiny decoder's shape (4 heads, 2 k/v heads, hidden 128) in 2 blocks with a
512-token vocabulary, taken from the 7b preset for its 4096-position limit. On a CPU machine
with fewer cores than ranks the cp ranks share cores: the step times show the exchange's and
the kernels' cost, not a speed-up.

    .venv/bin/python benchmarks/context_parallel.py [--budget-mb 16] [--time-seq 512]
"""

from __future__ import annotations

import argparse
import sys

from common import add_smoke, check, median, preamble, slowest_rank_steps, steady, table
from shardwise.config import load_config
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_world
from shardwise.plan.hardware import get_hardware
from support.compare import VOCAB

SHAPE = [
    "--model.name=7b",  # (the tiny shape below, with 7b's 4096 positions)
    "--model.n_layers=2",
    "--model.dim=128",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=352",
    f"--model.vocab_size={VOCAB}",  # the parity tests' cached BPE
    "--train.global_batch=1",
    "--train.eval_batches=0",
    "--optim.warmup_steps=1",
]


def overrides(cp: int, seq: int, steps: int, mode: str = "ring") -> list[str]:
    more = [f"--parallel.cp={cp}", f"--parallel.cp_mode={mode}"] if cp > 1 else []
    return [*SHAPE, f"--data.seq_len={seq}", f"--train.steps={steps}", *more]


def world(cp: int, lengths: list[int], time_seq: int, steps: int, rounds: int) -> tuple:
    """One world of `cp` ranks: a 1-step run at each of `lengths` (their activations per
    rank, max over ranks) and the timed runs at `time_seq` (cp = 1: one; else ring and
    Ulysses, alternating A B B A over `rounds`). Returns (activations per length, median
    steady step per mode)."""
    modes = ["ring"] if cp == 1 else ["ring", "ulysses"]
    timed = [m for r in range(rounds) for m in (modes if r % 2 == 0 else modes[::-1])]
    cases = [{"overrides": overrides(cp, seq, 1)} for seq in lengths]
    cases += [{"overrides": overrides(cp, time_seq, steps, m)} for m in timed]
    out = run_world(cp, cases)
    check(out)
    act = {
        seq: max(r["records"][-1]["mem_bytes"]["activations"] for r in per_rank)
        for seq, per_rank in zip(lengths, out, strict=False)
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    for m, per_rank in zip(timed, out[len(lengths) :], strict=True):
        times[m].append(median(steady(slowest_rank_steps(per_rank))))
    return act, {m: median(t) for m, t in times.items()}


def predicted(cp: int, seq: int) -> int:
    """The planner's (`explain`) activations per rank for the same run."""
    cfg = load_config(None, overrides(cp, seq, 1))
    return explain_record(cfg, cp, get_hardware("cpu", calibrate=False))["mem_bytes"]["activations"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mb", type=float, default=16.0, help="activations per rank")
    ap.add_argument("--min-seq", type=int, default=256)
    ap.add_argument("--max-seq", type=int, default=4096)
    ap.add_argument("--time-seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    add_smoke(ap)
    args = ap.parse_args()
    cps = [1, 2, 4]
    if args.smoke:
        cps, args.budget_mb, args.min_seq, args.max_seq = [1, 2], 2.0, 64, 128
        args.time_seq, args.steps, args.rounds = 64, 2, 1
    preamble()
    budget = args.budget_mb * 1e6
    lengths = []
    while args.min_seq * 2 ** len(lengths) <= args.max_seq:
        lengths.append(args.min_seq * 2 ** len(lengths))
    rows, best, times = [], {}, {}
    for cp in cps:
        act, steps = world(cp, lengths, args.time_seq, args.steps, args.rounds)
        fitting = [seq for seq in lengths if act[seq] <= budget]  # activations grow with seq
        best[cp] = max(fitting) if fitting else None
        for seq in lengths:
            fits = "yes" if act[seq] <= budget else "no"
            rows.append([cp, seq, f"{act[seq] / 1e6:.2f}", f"{predicted(cp, seq) / 1e6:.2f}", fits])
        times.update({"cp1" if cp == 1 else f"cp{cp} {m}": t for m, t in steps.items()})
    print(f"\n(a) longest sequence within {args.budget_mb:g} MB of activations per rank")
    print(table(["cp", "seq_len", "measured MB", "predicted MB", "fits"], rows))
    for cp in cps:
        print(f"cp {cp}: longest {best[cp] or 'none'} of {lengths} within the budget")
    print(f"\n(b) step time at seq_len {args.time_seq}, one sample a step")
    base, out = times["cp1"], []
    for name, t in times.items():
        ratio = ""
        if name.endswith("ring"):
            ratio = f"{t / times[name.replace('ring', 'ulysses')]:.2f}"
        out.append([name, f"{t * 1000:.1f}", f"{t / base:.2f}", ratio])
    print(table(["run", "median step ms", "vs cp1", "ring / ulysses"], out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
