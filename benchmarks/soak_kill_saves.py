"""Kill soak of checkpoint saves: the whole job SIGKILLed at random moments while it saves,
N times (20; --smoke: 3), with `checkpoint.keep=1`; then run to the end.

Each round runs `shardwise train --nproc 1 --checkpoint.every=1 --checkpoint.keep=1` (a tiny
decoder: a save every step) and, once a random number (1-3) of further saves has begun (a
`step-N.tmp` or `step-N.deleting` directory appears), waits 0-20 ms and SIGKILLs its whole
process group: the kill lands in a shard write, the index write, the rename, the `latest`
update or the pruning. Before the first round the user's files are planted where a careless
job would hit them: a note in checkpoint.dir, a `.lock` of the user's in run.dir, a
step-named directory of the user's, and (after the first round that saved one) a note inside
the checkpoint that will be pruned next. The last round runs to the end. It survives when
that run exits 0, `latest` names a checkpoint whose files all match their SHA-256, no other
checkpoint of the run and no leftover of a save remain, and every planted file is byte for
byte unchanged.
Prints one line per kill and `survived: verified ...` or `FAILED: ...`.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_smoke, command_line, load
from shardwise.checkpoint import io

RUN = [
    "--model.n_layers=2",
    "--model.vocab_size=512",
    "--data.seq_len=32",
    "--train.global_batch=8",
    "--train.eval_every=0",
    "--train.eval_batches=0",
    "--checkpoint.every=1",
    "--checkpoint.keep=1",
    "--log.tensorboard=false",
    "--log.progress=off",
]
SAVING = re.compile(r"^step-\d{8}\.(tmp|deleting)$")


def _cmd(run_dir: Path, steps: int) -> list[str]:
    head = [sys.executable, "-m", "shardwise.cli.main", "train", "--nproc", "1"]
    return [*head, *RUN, f"--train.steps={steps}", f"--run.dir={run_dir}"]


def _env() -> dict[str, str]:
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and "SLURM" not in k}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _saving(root: Path) -> set[str]:
    try:
        return {c.name for c in root.iterdir() if SAVING.match(c.name)}
    except OSError:
        return set()


def kill_during_saves(cmd: list[str], root: Path, rng: random.Random) -> tuple[bool, str]:
    """Run `cmd`; SIGKILL its process group inside a save after 1-3 saves began; (whether it
    was killed so, what it saw)."""
    log = root.parent / "soak.log"  # (a file, not a pipe: a full pipe would stall the job)
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    want, seen, deadline = rng.randint(1, 3), set(), time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            now = _saving(root)
            if now - seen:
                seen |= now
                want -= 1
                if want <= 0:
                    delay = rng.uniform(0, 0.02)
                    time.sleep(delay)
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return True, f"killed {delay * 1000:4.1f} ms after {sorted(now)[0]} appeared"
            time.sleep(0.001)
        return False, f"not reached: exit {proc.poll()}: {log.read_text()[-500:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def plant(run_dir: Path, root: Path) -> dict[Path, str]:
    """The user's files a job must never touch; returns their digests."""
    root.mkdir(parents=True)
    (root / "notes.txt").write_text("my notes about these checkpoints\n")
    (run_dir / ".lock").write_text("a lock of the user's\n")
    mine = root / "step-99999999"
    mine.mkdir()
    (mine / "mine.txt").write_text("a folder of the user's with a step name\n")
    return {p: _digest(p) for p in (root / "notes.txt", run_dir / ".lock", mine / "mine.txt")}


def check(run_dir: Path, root: Path, planted: dict[Path, str]) -> list[str]:
    """What is wrong with the directories after the last run (nothing: [])."""
    problems = [f"{p} changed or was removed" for p, d in planted.items()
                if not p.is_file() or _digest(p) != d]  # fmt: skip
    newest = io.latest(root)
    if newest is None:
        return [*problems, "no `latest`"]
    index, bad = io.check_index(newest)
    bad = bad or io.check_files(newest, index["files"])
    problems += [f"{newest.name}: {b}" for b in bad]
    ours = [p.name for _, p in io.list_complete(root) if p != newest]
    if ours:
        problems.append(f"other complete checkpoints left with keep=1: {ours}")
    left = sorted(_saving(root))
    if left:
        problems.append(f"leftovers of a save: {left}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="whole-job kills during saves")
    parser.add_argument("--seed", type=int, default=None, help="kill-moment seed (random)")
    parser.add_argument("--dir", default=None, help="work directory (default: a new temporary)")
    add_smoke(parser)
    args = parser.parse_args()
    # stopped itself (a timeout's SIGTERM): unwind, so the job being run is killed too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    kills = 3 if args.smoke else args.kills
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"$ {command_line()}")
    now = datetime.datetime.now(datetime.UTC)
    print(f"date: {now:%Y-%m-%d %H:%M} UTC  load average at the start: {load()}  seed {seed}")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="soak-kill-saves-"))
    run_dir = work / "run"
    root = run_dir / "checkpoints"
    planted = plant(run_dir, root)
    rng = random.Random(seed)
    killed = 0
    for i in range(kills):
        ok, seen = kill_during_saves(_cmd(run_dir, 100_000), root, rng)
        killed += ok
        latest = getattr(io.latest(root), "name", None)
        print(f"kill {i + 1:2d}/{kills}: {seen}; latest {latest}", flush=True)
        newest = io.latest(root)
        inside = [p for p in planted if p.parent.name.startswith("step-0")]
        if newest is not None and not inside:  # a note inside the checkpoint pruned next
            note = newest / "notes.txt"
            note.write_text("a note inside a checkpoint\n")
            planted[note] = _digest(note)
    last = io.latest(root)
    steps = (int(last.name.rpartition("-")[2]) if last else 0) + 2
    final = subprocess.run(_cmd(run_dir, steps), env=_env(), capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    problems = [] if killed == kills else [f"{kills - killed} round(s) ended without a kill"]
    if final.returncode:
        problems.append(f"the last run exited {final.returncode}")
        print(final.stderr[-3000:])
    problems += check(run_dir, root, planted)
    if problems:
        print("FAILED: " + "; ".join(problems))
    else:
        newest = io.latest(root)
        print(f"survived: verified {newest.name} (every SHA-256 matches), {len(planted)} user "
              f"files untouched, no leftovers, after {killed} kills")  # fmt: skip
    print(f"load at the end: {load()}")
    if not problems and args.dir is None:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
