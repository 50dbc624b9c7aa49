"""Training stall per checkpoint save: synchronous vs `checkpoint.async`, beside PyTorch DCP.

What it measures: on 2 gloo ranks, a decoder whose checkpointed state (fp32 parameters and
AdamW moments) is >= 50 MB trains 20 steps saving every 5. The stall of a save is the time
the training loop spends inside `maybe_save` (metrics `checkpoint_stall_s`): for a
synchronous save the whole save (snapshot, serialise, write, fsync, checksums, commit), for an
async one the host snapshot plus any wait for the previous save. Also printed: the median
time of the steps without a save (does the background writer slow training?), and the peer,
PyTorch Distributed Checkpoint on the same model and optimizer state: `dcp.save` and the
return time of `dcp.async_save`. Cases run in alternating order over rounds in ONE world so
that load drift hits all alike; medians over rounds.

Target: async stall < 20% of the synchronous save time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from common import (
    CKPT_EVERY,
    CKPT_NPROC,
    CKPT_RUN,
    CKPT_SMOKE,
    add_smoke,
    checkpoint_world,
    load,
    median,
    table,
)


def cases(root: Path, rounds: int, smoke: bool = False) -> list[tuple[str, dict]]:
    out, run = [], [*CKPT_RUN, *CKPT_SMOKE] if smoke else CKPT_RUN
    for r in range(rounds):
        order = ["sync", "async", "dcp"] if r % 2 == 0 else ["dcp", "async", "sync"]
        for kind in order:
            ckpt = [f"--checkpoint.dir={root}/{kind}{r}", "--checkpoint.resume=none"]
            if kind == "dcp":
                case = {"overrides": [*run, *ckpt], "peer": "support.ckpt_peers:dcp_peer"}
            else:
                flag = "true" if kind == "async" else "false"
                every = [f"--checkpoint.every={CKPT_EVERY}", f"--checkpoint.async={flag}"]
                case = {"overrides": [*run, *ckpt, *every]}
            out.append((kind, case))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke(parser)
    args, root, results = checkpoint_world(parser, "ckpt-bench-", cases)
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    plain: dict[str, list[float]] = {"sync": [], "async": []}
    dcp: dict[str, list[float]] = {"dcp_sync_s": [], "dcp_async_stall_s": []}
    size = 0
    for kind, per_rank in results:
        if kind == "dcp":
            for key in dcp:  # the slowest rank decides when training can go on
                dcp[key] += [max(v) for v in zip(*(r[key] for r in per_rank), strict=True)]
            continue
        records = [r["records"] for r in per_rank]
        for step in range(len(records[0])):
            worst = max(rec[step].get("checkpoint_stall_s", 0.0) for rec in records)
            time = max(rec[step]["step_time_s"] for rec in records)
            if "checkpoint_stall_s" in records[0][step]:
                stalls[kind].append(worst)
            elif step >= 2:
                plain[kind].append(time)
    newest = sorted((root / "sync0").glob("step-*"))[-1]
    size = sum(f.stat().st_size for f in newest.glob("*.safetensors"))
    if args.smoke:  # the suite's run leaves nothing behind; a real one keeps its checkpoints
        shutil.rmtree(root, ignore_errors=True)
    print(f"checkpointed state: {size / 1e6:.1f} MB in {CKPT_NPROC} files (fp32 params + AdamW)")
    sync_s, async_s = median(stalls["sync"]), median(stalls["async"])
    dsync, dasync = median(dcp["dcp_sync_s"]), median(dcp["dcp_async_stall_s"])
    rows = [
        ["shardwise sync", f"{sync_s:.3f}", "1.00", f"{median(plain['sync']):.3f}"],
        [
            "shardwise async",
            f"{async_s:.3f}",
            f"{async_s / sync_s:.2f}",
            f"{median(plain['async']):.3f}",
        ],
        ["DCP save", f"{dsync:.3f}", f"{dsync / sync_s:.2f}", "-"],
        ["DCP async_save", f"{dasync:.3f}", f"{dasync / sync_s:.2f}", "-"],
    ]
    header = ["save", "stall per save s (median)", "/ shardwise sync", "step s without a save"]
    print(table(header, rows))
    print(f"async stall / sync save = {async_s / sync_s:.3f} (target < 0.20)")
    print(f"ours / DCP: sync {sync_s / dsync:.2f}x, async stall {async_s / dasync:.2f}x")
    print(f"load average at the end: {load()}")
    if async_s / sync_s >= 0.2 and not args.smoke:
        sys.exit("async stall is not under 20% of the synchronous save time")


if __name__ == "__main__":
    main()
