"""Optimizer state on local disk (`memory.offload=optimizer+nvme`) against host offload.

What it measures: on 2 gloo ranks under ZeRO-1 in fp32, the same decoder trained with its fp32
masters and AdamW moments in host memory (`memory.offload=optimizer`) and on disk
(`optimizer+nvme`, in `--nvme-dir`), in rounds of alternating order in ONE spawned world. Per
case: the median step time after warm-up (slowest rank per step) and the optimizer part of
it (`ledger.optimizer_s`); per engine the median over rounds; the ratios nvme / host; the host
bytes of the optimizer state each keeps (`mem_bytes` host_master + host_optimizer) and the
bytes on disk. The losses must agree bit for bit (tests/test_nvme.py checks the parameters).
Why: NVMe offload is worth it when the state does not fit in host memory; what it may cost
is the step time the disk adds beyond host offload. DeepSpeed's ZeRO-Infinity, the one peer
with NVMe offload, needs its libaio op, which is not built on these machines.
"""

from __future__ import annotations

import argparse
import tempfile

from common import add_smoke, engine_rounds, median, preamble, steady, table
from shardwise.launchers.harness import run_world

NPROC = 2


def base(steps: int, size: list[str]) -> list[str]:
    return [
        "--model.name=tiny",
        *size,
        "--data.seq_len=64",
        "--train.global_batch=4",
        f"--train.steps={steps}",
        "--train.seed=0",
        "--train.eval_every=0",
        "--train.eval_batches=0",
        "--precision.compute=fp32",
        "--parallel.zero=1",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per case (5 warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="repetitions, order alternating")
    parser.add_argument("--nvme-dir", default=None, help="the disk to use (default: a temp dir)")
    parser.add_argument("--buffer-mb", type=float, default=4.0, help="memory.nvme_buffer_mb")
    add_smoke(parser)
    args = parser.parse_args()
    steps, rounds = (3, 1) if args.smoke else (args.steps, args.rounds)
    size = [] if args.smoke else ["--model.n_layers=8", "--model.dim=512", "--model.ffn_dim=1408"]
    if args.nvme_dir:
        return measure(args, steps, rounds, size, args.nvme_dir)
    with tempfile.TemporaryDirectory(prefix="nvme-bench-") as scratch:  # removed at the end
        return measure(args, steps, rounds, size, scratch)


def measure(args, steps: int, rounds: int, size: list[str], folder: str) -> int:
    engines = [
        ("host", ["--memory.offload=optimizer"], None),
        (
            "nvme",
            [
                "--memory.offload=optimizer+nvme",
                f"--memory.nvme_dir={folder}",
                f"--memory.nvme_buffer_mb={args.buffer_mb}",
            ],
            None,
        ),
    ]
    cases, keys = engine_rounds(engines, base(steps, size), rounds)
    by_key = dict(zip(keys, run_world(NPROC, cases), strict=True))
    for key, per_rank in by_key.items():
        assert all("error" not in r for r in per_rank), (key, per_rank[0].get("error"))

    def med(name: str, field) -> float:
        per_round = []
        for r in range(rounds):
            per_rank = by_key[name, r]
            steps_ = [max(field(p["records"][i]) for p in per_rank) for i in range(steps)]
            per_round.append(median(steady(steps_)))
        return median(per_round)

    preamble()
    print(f"nvme_dir: {folder}")
    rows, got = [], {}
    for name in ("host", "nvme"):
        rec = by_key[name, 0][0]["records"][-1]
        mem = rec["mem_bytes"]
        got[name] = (
            med(name, lambda r: r["step_time_s"]),
            med(name, lambda r: r["ledger"]["optimizer_s"]),
        )
        rows.append(
            [
                name,
                f"{got[name][0] * 1e3:.1f}",
                f"{got[name][1] * 1e3:.1f}",
                f"{(mem['host_master'] + mem['host_optimizer']) / 1e6:.1f}",
                f"{mem.get('disk_optimizer', 0) / 1e6:.1f}",
                f"{by_key[name, 0][0]['losses'][-1]:.6f}",
            ]
        )
    print(
        table(
            ["offload", "step ms", "optimizer ms", "host MB (state)", "disk MB", "last loss"],
            rows,
        )
    )
    print(
        f"nvme / host: step {got['nvme'][0] / got['host'][0]:.2f}, "
        f"optimizer {got['nvme'][1] / got['host'][1]:.2f}; losses equal: "
        f"{by_key['host', 0][0]['losses'] == by_key['nvme', 0][0]['losses']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
