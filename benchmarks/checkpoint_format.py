"""Checkpoint save stall and size: `checkpoint.format=shardwise` vs `dcp`, sync and async.

What it measures: on 2 gloo ranks with ZeRO-3 (every tensor sliced into flat spans, which
the DCP format describes as rectangular chunks), a decoder whose checkpointed state (fp32
parameters and AdamW moments) is >= 50 MB trains 20 steps saving every 5. The stall of a save
is the time the loop spends inside `maybe_save` (metrics `checkpoint_stall_s`, the slowest
rank's): the whole save when synchronous, the host snapshot (plus any wait for the previous
save) when async. Also: the bytes of one checkpoint on disk, and whether the four runs'
losses are identical (the format must not change training). Cases run in alternating order
over rounds in ONE world so that load drift hits all alike; medians over rounds.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from common import (
    CKPT_EVERY,
    CKPT_RUN,
    CKPT_SMOKE,
    add_smoke,
    checkpoint_world,
    load,
    median,
    table,
)

RUN = [*CKPT_RUN, "--parallel.zero=3"]
KINDS = ["shardwise", "dcp", "shardwise async", "dcp async"]


def cases(root: Path, rounds: int, smoke: bool = False) -> list[tuple[str, dict]]:
    out, run = [], [*RUN, *CKPT_SMOKE] if smoke else RUN
    for r in range(rounds):
        for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
            fmt, *mode = kind.split()
            ckpt = [
                f"--checkpoint.dir={root}/{kind.replace(' ', '_')}{r}",
                "--checkpoint.resume=none",
                f"--checkpoint.every={CKPT_EVERY}",
                f"--checkpoint.format={fmt}",
                f"--checkpoint.async={'true' if mode else 'false'}",
            ]
            out.append((kind, {"overrides": [*run, *ckpt]}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke(parser)
    args, root, results = checkpoint_world(parser, "ckpt-format-", cases)
    stalls: dict[str, list[float]] = {k: [] for k in KINDS}
    losses: dict[str, list[float]] = {}
    for kind, per_rank in results:
        records = [r["records"] for r in per_rank]
        for step in range(len(records[0])):
            if "checkpoint_stall_s" in records[0][step]:
                stalls[kind].append(max(rec[step]["checkpoint_stall_s"] for rec in records))
        losses.setdefault(kind, per_rank[0]["losses"])
    sizes = {}
    for kind in ("shardwise", "dcp"):
        newest = sorted((root / f"{kind}0").glob("step-*"))[-1]
        sizes[kind] = sum(f.stat().st_size for f in newest.iterdir() if f.name != "index.json")
    if args.smoke:  # the suite's run leaves nothing behind; a real one keeps its checkpoints
        shutil.rmtree(root, ignore_errors=True)
    base = median(stalls["shardwise"])
    rows = []
    for kind in KINDS:
        s = median(stalls[kind])
        size = sizes[kind.split()[0]]
        rows.append([kind, f"{s:.3f}", f"{s / base:.2f}", f"{size / 1e6:.1f}"])
    header = ["save", "stall per save s (median)", "/ shardwise sync", "MB on disk"]
    print(table(header, rows))
    same = all(losses[k] == losses["shardwise"] for k in KINDS)
    print(f"losses identical across formats and modes: {same}")
    print(f"load average at the end: {load()}")
    if not same:
        raise SystemExit("the checkpoint format changed the training losses")


if __name__ == "__main__":
    main()
