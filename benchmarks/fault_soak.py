"""Fault soak: kill a rank, or stop the job with SIGTERM or SIGINT, at random
moments, 20 times each; every run must finish and end bitwise equal to the uninterrupted one.

Each trial runs `shardwise train --nproc 2 --max-restarts 3 --checkpoint.every=2` on a tiny
decoder for 12 steps and SIGKILLs one randomly chosen rank from outside
(`support.chaos`): in half of the trials after a random step, in the other half
while a randomly chosen save is being written (as soon as its `.tmp` directory appears).
torch elastic restarts both ranks; they resume from the newest valid checkpoint. A trial
survives when the job exits 0, `metrics.jsonl` holds steps 1..12 once each with the
reference losses, and every tensor of the final checkpoint (parameters, Adam moments) equals
the reference run's bit for bit. SIGTERM (to the launcher, as Kubernetes or Slurm send it)
and SIGINT (to the process group, as Ctrl-C does) trials: the job must save and exit 143 / 130;
the same command is then run again (as a requeued job is) and must pass the same checks.
Prints one line per trial and `survived k/N` per signal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import add_smoke, command_line, load
from shardwise.checkpoint import io as io
from shardwise.checkpoint import slices
from support.chaos import run_and_kill

STEPS, EVERY = 12, 2
RUN = [
    "--model.n_layers=2",
    "--data.seq_len=32",
    "--train.global_batch=8",
    f"--train.steps={STEPS}",
    "--train.eval_every=0",
    "--train.eval_batches=0",
    "--optim.warmup_steps=5",
    "--train.lr=1e-3",
    f"--checkpoint.every={EVERY}",
    "--log.tensorboard=false",
    "--log.progress=off",
]


def _cmd(run_dir: Path) -> list[str]:
    head = [sys.executable, "-m", "shardwise.cli.main", "train", "--nproc", "2"]
    return [*head, "--max-restarts", "3", *RUN, f"--run.dir={run_dir}"]


def _env() -> dict[str, str]:
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and "SLURM" not in k}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    index = io.read_index(path)
    return {k: slices.read_tensor(path, k, index) for k in index["tensors"]}


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def _differences(ref: dict, got: dict) -> list[str]:
    if ref.keys() != got.keys():
        return [f"tensor sets differ: {sorted(set(ref) ^ set(got))[:5]}"]
    out = []
    for key in ref:
        if not torch.equal(ref[key], got[key]):
            diff = (ref[key].double() - got[key].double()).abs().max().item()
            out.append(f"{key} max|diff| {diff:.3g}")
    return out


SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}


def trial(
    i: int, rng: random.Random, root: Path, ref: dict, ref_losses: list, sig: str = "kill"
) -> tuple[bool, str]:
    run_dir = root / f"{sig}{i:02d}"
    when = rng.choice(["step", "save"])
    at = rng.randint(1, STEPS - 1) if when == "step" else EVERY * rng.randint(1, STEPS // EVERY)
    t0 = time.monotonic()
    cmd, ckpt = _cmd(run_dir), run_dir / "checkpoints"
    result = run_and_kill(cmd, _env(), run_dir, ckpt, when, at, rng, sig=SIGNALS[sig])
    where = f"{sig} {when} {at}: {result.killed_at or 'not reached'}"
    if sig != "kill" and result.killed_pid is not None:  # stopped and saved: run it again
        if result.returncode != 128 + SIGNALS[sig]:
            return False, f"{where}; exit {result.returncode}\n{result.output[-2000:]}"
        where += f"; exit {result.returncode}, rerun"
        again = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        result.returncode, result.output = again.returncode, again.stdout + again.stderr
        if "resumed from" not in result.output:  # it must continue, not start over
            return False, f"{where}; the rerun did not resume\n{result.output[-2000:]}"
    took = time.monotonic() - t0
    if result.returncode != 0:
        return False, f"{where}; exit {result.returncode}\n{result.output[-2000:]}"
    problems = []
    if result.killed_pid is None:
        problems.append("no rank was killed (the run ended first)")
    if _losses(run_dir) != ref_losses:
        problems.append(f"metrics differ: {_losses(run_dir)} vs {ref_losses}")
    problems += _differences(ref, _final(run_dir))
    restarts = result.output.count("resumed after restart")
    status = "; ".join(problems) if problems else "bitwise equal"
    return not problems, f"{where}; {restarts} resume(s) after restart; {took:.0f} s; {status}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per signal")
    parser.add_argument(
        "--signals", default="kill,term,int", help="comma-separated: kill, term, int"
    )
    parser.add_argument("--seed", type=int, default=None, help="kill-point seed (random)")
    add_smoke(parser)
    args = parser.parse_args()
    args.trials = 1 if args.smoke else args.trials
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"$ {command_line()}")
    print(f"date: {datetime.date.today()}  load average at the start: {load()}  seed {seed}")
    root = Path(tempfile.mkdtemp(prefix="fault-soak-"))
    subprocess.run(_cmd(root / "reference"), env=_env(), check=True, capture_output=True)
    ref, ref_losses = _final(root / "reference"), _losses(root / "reference")
    rng = random.Random(seed)
    signals = args.signals.split(",")
    if args.smoke:
        signals = signals[:1] if len(signals) == 1 else ["term"]  # the new path, once
    failed = 0
    for sig in signals:
        survived = 0
        for i in range(args.trials):
            ok, line = trial(i, rng, root, ref, ref_losses, sig)
            survived += ok
            print(f"{sig} trial {i + 1:2d}: {'ok  ' if ok else 'FAIL'} {line}", flush=True)
        print(f"{sig}: survived {survived}/{args.trials}", flush=True)
        failed += args.trials - survived
    if args.smoke and not failed:  # the suite's run leaves nothing behind
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at the end: {load()}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
