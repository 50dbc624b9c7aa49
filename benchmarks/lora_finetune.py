"""LoRA fine-tuning: ours beside PyTorch DDP and FSDP2 over the same peft model, side by side.

What it measures: a decoder (4 blocks, 256 wide, the stdlib corpus, seq_len 128, fp32) with
peft LoRA adapters of rank 16 on every block linear (`--finetune.lora_rank=16`), in ONE
spawned world of 2 gloo ranks, in alternating rounds: ours dp2 (ZeRO-0) and dp2 ZeRO-3,
PyTorch's DistributedDataParallel and FSDP2 (`fully_shard` per block, then the root) on the
same peft-wrapped module, weights, data order, AdamW and clipping (support.peers.ddp_peer,
support.zero_peers.fsdp2_peer); and, for scale, ours full fine-tuning with ZeRO-3 and ours LoRA
with 8-bit AdamW, QLoRA (an NF4 base, split over the ranks) and an int8 base. Printed: median
step time per engine (steps after warm-up, slowest rank) and the ratio to DDP, the largest
relative loss difference from one process of ours, and model-state bytes per rank (ours from
`mem_bytes`, the peers' from their own storages).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from common import (
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

NPROC = 2
DDP = "support.peers:ddp_peer"
FSDP2 = "support.zero_peers:fsdp2_peer"
LORA = ["--finetune.lora_rank=16", "--finetune.lora_alpha=32"]


def overrides(steps: int, smoke: bool) -> list[str]:
    size = ["--model.n_layers=1", "--model.dim=64", "--data.seq_len=32"] if smoke else []
    return [
        "--model.n_layers=4",
        "--model.dim=256",
        "--model.n_heads=4",
        "--model.n_kv_heads=4",
        "--model.ffn_dim=704",
        "--model.vocab_size=4096",
        "--data.seq_len=128",
        "--train.global_batch=8",
        f"--train.steps={steps}",
        "--train.lr=1e-3",
        "--optim.warmup_steps=2",
        "--train.eval_every=0",
        "--train.eval_batches=0",
        *size,
    ]


ENGINES = [
    ("ours LoRA z0", [*LORA], None),
    ("ours LoRA z3", [*LORA, "--parallel.zero=3"], None),
    ("DDP + peft", [*LORA], DDP),
    ("FSDP2 + peft", [*LORA], FSDP2),
    ("ours LoRA z3 8-bit", [*LORA, "--parallel.zero=3", "--optim.name=adamw8bit"], None),
    ("ours QLoRA z3", [*LORA, "--parallel.zero=3", "--finetune.base_quant=nf4"], None),
    ("ours int8 base z3", [*LORA, "--parallel.zero=3", "--finetune.base_quant=int8"], None),
    ("ours full z3", ["--parallel.zero=3"], None),
]


def _states(res: dict) -> int:
    if "records" in res:
        mem = res["records"][-1]["mem_bytes"]
        return sum(mem.get(k, 0) for k in ("params", "grads", "master", "optimizer"))
    return sum(res.get("state_bytes", {}).values()) if "state_bytes" in res else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every engine (ABBA)")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.rounds = 2, 1
    preamble()
    base = overrides(args.steps, args.smoke)
    print(f"case: {' '.join(base)} {' '.join(LORA)}")
    cases, keys = engine_rounds(ENGINES, base, args.rounds)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        one = run_here({"overrides": [*base, *LORA]}, tmp)
    results = run_world(NPROC, cases)
    check(results)
    by_key = dict(zip(keys, results, strict=True))
    times = engine_times(by_key, [name for name, _, _ in ENGINES], args.rounds)
    rows = []
    for name, _, _ in ENGINES:
        first = by_key[name, 0][0]
        lora = not any(k in name for k in ("full", "8-bit", "QLoRA", "int8"))  # fp32 LoRA
        dloss = max(
            abs(a - b) / abs(b) for a, b in zip(first["losses"], one["losses"], strict=True)
        )
        rows.append(
            [
                name,
                f"{times[name] * 1000:.0f}",
                f"{times[name] / times['DDP + peft']:.3f}",
                f"{dloss:.1e}" if lora else "-",
                mb(_states(first)) if _states(first) else "-",
            ]
        )
    header = ["engine (2 ranks)", "step ms", "/ DDP+peft", "max rel dloss vs 1 proc"]
    print(table([*header, "model states MB/rank"], rows))
    full = _states(by_key["ours full z3", 0][0])
    for name in ("ours LoRA z3", "ours QLoRA z3", "ours int8 base z3"):
        below = full / _states(by_key[name, 0][0])
        print(f"{name[5:]} model states {below:.1f}x below full fine-tuning z3 (fp32, same model)")
    print(f"load average at the end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
