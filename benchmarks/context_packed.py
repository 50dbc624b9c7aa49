"""Context-parallel attention on packed records: what the record mask costs or saves the ring
and Ulysses kernels, forward and backward, against the same kernels on one causal sequence.

In one world of cp ranks (cp 2, then cp 4), each kernel runs forward and backward on a
[1, 4, seq/cp, 32] fp32 part of a --seq-token sequence, --repeats times per variant in
alternating rounds (plain, packed, packed, plain, ...): plain causal attention, and the same
sequence packed as records of --record tokens (parallel/context_comm.py `starts`). The median
call of the slowest rank is printed, with packed / plain, and how many of the ring's cp x cp
(query rank, key rank) block pairs each rank computes: with records shorter than a zig-zag
chunk a rank's queries see only its own keys, so the ring skips the other pairs' compute
(their K/V still travel: the traffic does not depend on the records), while Ulysses attends
over the whole sequence under a [seq, seq] record mask.

On a CPU machine with fewer cores than ranks the ranks share cores: ratios within one world
only.

    .venv/bin/python benchmarks/context_packed.py [--seq 4096] [--record 256] [--repeats 6]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from common import add_smoke, median, preamble, table
from shardwise.config import Config
from shardwise.distributed.comm import Comm
from shardwise.distributed.topology import build_topology
from shardwise.launchers.harness import run_world
from shardwise.parallel.context_comm import (
    _all_positions,
    _blocks,
    ring_attention,
    ulysses_attention,
    zigzag_positions,
)

B, H, D = 1, 4, 32
KERNELS = {"ring": ring_attention, "ulysses": ulysses_attention}


def _starts(pos: torch.Tensor, record: int) -> torch.Tensor:
    """[B, S_local]: where each local query's record (of `record` tokens) starts."""
    return (pos - pos % record)[None].expand(B, -1)


def _call(kernel, q, k, v, dout, pos, comm, starts) -> float:
    """Seconds of one forward and backward, ranks aligned before and after."""
    comm.all_reduce(torch.zeros(1), "cp", control=True)  # start together
    t0 = time.perf_counter()
    out = kernel(q, k, v, pos, comm, starts)
    out.backward(dout)
    return time.perf_counter() - t0


def speed(cfg: Config) -> dict:
    """Peer case (each rank): median seconds per forward + backward of each kernel, plain and
    packed, and the ring's computed block pairs on this rank. cfg.data.seq_len: the sequence,
    cfg.train.steps: the repeats, cfg.train.micro_batch: the record length."""
    comm = Comm(build_topology(1, 1, "cpu", 300.0, cp=dist.get_world_size()))
    n, r = comm.topo.size("cp"), comm.topo.coord("cp")
    seq, repeats, record = cfg.data.seq_len, cfg.train.steps, cfg.train.micro_batch
    pos = zigzag_positions(seq, n, r)
    gen = torch.Generator().manual_seed(r)
    q, k, v, dout = (torch.randn(B, H, seq // n, D, generator=gen) for _ in range(4))
    out = {}
    for name, kernel in KERNELS.items():
        times = {"plain": [], "packed": []}
        for i in range(repeats):
            for variant in ("plain", "packed") if i % 2 == 0 else ("packed", "plain"):
                starts = _starts(pos, record) if variant == "packed" else None
                qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
                times[variant].append(_call(kernel, qs, ks, vs, dout, pos, comm, starts))
        out.update({f"{name} {v}": median(t[1:] or t) for v, t in times.items()})
    every = _all_positions(pos, comm).cpu()
    plan = _blocks(every, r, "cpu", _starts(pos, record))
    out["pairs"] = sum(1 for b in plan if b is not None and not b.empty)
    out["pairs_plain"] = sum(1 for b in _blocks(every, r, "cpu") if b is not None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--record", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=6)
    add_smoke(ap)
    args = ap.parse_args()
    cps = [2, 4]
    if args.smoke:
        cps, args.seq, args.record, args.repeats = [2], 256, 32, 2
    preamble()
    case = {
        "peer": "context_packed:speed",
        "overrides": [
            f"--data.seq_len={args.seq}",
            f"--train.steps={args.repeats}",
            f"--train.micro_batch={args.record}",
        ],
    }
    rows = []
    for cp in cps:
        (per_rank,) = run_world(cp, [case])
        slowest = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
        pairs = f"{min(r['pairs'] for r in per_rank)}-{max(r['pairs'] for r in per_rank)}"
        for name in KERNELS:
            plain, packed = slowest[f"{name} plain"], slowest[f"{name} packed"]
            computed = f"{pairs} of {cp}" if name == "ring" else "-"
            ratio = f"{packed / plain:.2f}"
            rows.append([cp, name, f"{plain * 1e3:.1f}", f"{packed * 1e3:.1f}", ratio, computed])
    print(f"\nforward + backward, seq {args.seq}, records of {args.record} tokens, fp32")
    header = ["cp", "kernel", "plain ms", "packed ms", "packed / plain", "ring pairs a rank"]
    print(table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
