"""The causes of a slow step that the profile tests and benchmarks/profile_remedies.py inject,
each as (extra overrides, hook) on a tiny decoder with 2 ranks: a 40 ms delay per micro-batch
load, 75 gradient buckets of 0.0001 MB, pipeline pp2 with one micro-batch per step, rank 1
150 ms slower per forward, full recomputation where memory allows none."""

from __future__ import annotations

HOOKS = "support.hooks:"
BASE = [
    "--model.name=tiny",
    "--train.global_batch=8",
    "--train.eval_batches=0",
    "--log.tensorboard=false",
]
CAUSES: dict[str, tuple[list[str], str | None]] = {
    "data_wait": ([], HOOKS + "slow_data"),
    "exposed_dp_communication": (
        [
            "--model.n_layers=8",
            "--model.dim=32",
            "--model.n_heads=2",
            "--model.n_kv_heads=2",
            "--model.ffn_dim=64",
            "--data.seq_len=16",
            "--train.global_batch=4",
            "--parallel.bucket_mb=0.0001",
        ],
        None,
    ),
    "pipeline_bubble": (["--parallel.pp=2", "--train.micro_batch=8"], None),
    "straggler": ([], HOOKS + "slow_rank1"),
    "recompute": (["--memory.recompute=full"], None),
}
