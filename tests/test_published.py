"""The planner's GPU cost model (plan/gpu.py, the NCCL ring model in plan/time.py) and the
published runs it is checked against (benchmarks/published/, benchmarks/published_runs.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from shardwise.models.presets import ModelSpec, preset
from shardwise.plan import gpu, search
from shardwise.plan import time as tm
from shardwise.plan.hardware import get_hardware
from shardwise.plan.layout import Engine, Job, Layout

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
A100 = get_hardware("a100-80gb")


@pytest.fixture(scope="module")
def runs():
    sys.path.insert(0, str(BENCH))
    try:
        import published_runs
    finally:
        sys.path.remove(str(BENCH))
    return published_runs


def test_every_published_row_names_its_source_and_quotes_it(runs):
    rows = [
        json.loads(line)
        for path in sorted((BENCH / "published").glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    assert len(rows) >= 100
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))
    for r in rows:
        assert r["source"] and r["quote"].strip(), r["id"]
    cases, skipped = runs.split_cases(rows)
    assert len(cases) >= 200 and all(why for _, why in skipped)
    for c in cases:
        assert c.measured_s > 0 and c.job.devices == c.row["hardware"]["n_gpus"], c.row["id"]


def test_small_gemms_run_further_from_peak_than_large_ones():
    """The roofline plus a fixed cost per kernel: a 512-token micro-batch of a tp-8 shard
    reaches a smaller fraction of the GEMM peak than 8192 tokens of the whole layer."""
    peak = A100.peak["bf16"]

    def achieved(m, n, k):
        return 2 * m * n * k / gpu._gemm(A100, 2, m, n, k, peak) / peak

    small, large = achieved(512, 4096 // 8, 4096), achieved(8192, 4096, 4096)
    assert small < 0.8 * large
    assert large == pytest.approx(A100.matmul_eff, rel=0.05)


def test_fused_causal_attention_costs_less_than_the_unfused_square():
    spec = ModelSpec("gpt2", 1, 4096, 32, 32, 16384, 50304, 4096, tie_embeddings=True)
    peak = A100.peak["bf16"]
    fused = gpu._attention(A100, spec, 1, 1, 4096, 2, peak, unfused=False)
    unfused = gpu._attention(A100, spec, 1, 1, 4096, 2, peak, unfused=True)
    assert sum(fused) < sum(unfused)
    # selective recomputation repeats the attention core's forward only
    job = Job(spec, A100, 8, seq_len=4096, global_batch=8)
    none = gpu.micro_batch_seconds(A100, job, Layout(dp=8, recompute="none"), 1)
    sel = gpu.micro_batch_seconds(A100, job, Layout(dp=8, recompute="selective"), 1)
    assert sel - none == pytest.approx(fused[0], rel=1e-9)


def test_a_rings_traffic_crosses_all_the_nics_of_a_node():
    """ZeRO-3 over 64 GPUs (8 nodes): 8 ranks of the group share a node, so the node's 8 NICs
    carry the ring together; with tp 8 the same-sized dp groups have one rank per node."""
    spec = preset("7b")
    job = Job(spec, A100, 64, seq_len=4096, global_batch=64)
    wide = tm.step_time(job, Layout(dp=64, zero=3), {"optimizer": 8.0})
    one_nic = A100.with_overrides(per_node=1)
    narrow = tm.step_time(
        dataclasses.replace(job, hardware=one_nic), Layout(dp=64, zero=3), {"optimizer": 8.0}
    )
    calls = tm.collective_calls(job, Layout(dp=64, zero=3))["dp"]
    latency = calls * (A100.latency + 63 * A100.hop_s)
    assert (narrow["dp_comm_s"] - latency) == pytest.approx(8 * (wide["dp_comm_s"] - latency))


def test_other_frameworks_costs_where_they_differ():
    """Megatron-LM's scatter/gather pipeline sends carry 1/tp of the activation; its
    data-parallel all-reduce after backward is all exposed."""
    spec = preset("175b")
    megatron = Engine("megatron-lm", "paper", True, False, True)
    lay = Layout(tp=8, pp=8, dp=2, micro_batch=1, recompute="full")
    ours = Job(spec, A100, 128, seq_len=2048, global_batch=64)
    theirs = dataclasses.replace(ours, engine=megatron)
    assert tm.traffic(theirs, lay)["pp"] == pytest.approx(tm.traffic(ours, lay)["pp"] / 8)
    t = search.evaluate(theirs, lay)["time"]
    assert t["dp_exposed_s"] == t["dp_comm_s"] > 0
    assert search.evaluate(ours, lay)["time"]["dp_exposed_s"] < t["dp_comm_s"]
    # llm-foundry's fused cross entropy keeps 16-bit logits, its gradient written over them
    from shardwise.plan import memory as mem

    fused = dataclasses.replace(ours, engine=Engine("foundry", fused_loss=True))
    one = Layout(dp=128, micro_batch=1)
    logits = 2048 * spec.vocab_size
    saved = mem.activation_bytes(ours, one, 0) - mem.activation_bytes(fused, one, 0)
    assert saved == pytest.approx((4 - 2) * logits)
    assert mem.backward_transient(fused, one) == 0 < mem.backward_transient(ours, one)
    # DeepSpeed's 2021 ZeRO-3: a blocking gather per parameter tensor, so one tensor is held
    # and each layer pays a call per tensor
    ours = dataclasses.replace(ours, global_batch=128)
    ds = dataclasses.replace(ours, engine=Engine("ds", zero3_per_tensor=True))
    z3 = Layout(dp=128, zero=3, micro_batch=1, recompute="full")
    tensors = sum(len(u.entries) * u.count for u in mem.stage_units(ours, z3, 0))
    units = sum(u.count for u in mem.stage_units(ours, z3, 0))
    assert tm.collective_calls(ds, z3)["dp"] > tm.collective_calls(ours, z3)["dp"] * 2
    assert tensors > 2 * units
    assert mem.predict_memory(ds, z3)["buffers"] < mem.predict_memory(ours, z3)["buffers"] / 2


def test_the_published_3d_runs_are_predicted_within_15_percent(runs):
    """Held out from the calibration: every Megatron-LM 3D row (Narayanan et al. 2021 Table 1
    and Table 2's PTD-P rows, Korthikanti et al. 2022, the README's GPT-3 175B on 1,024 A100s)
    and BLOOM-176B's logged iterations, each within the issue's 15 % and fitting in memory."""
    keep = ("narayanan2021-t1-", "korthikanti2022-t5-", "megatron-readme-gpt3", "bloom-tr11-")
    rows = [r for r in runs.load_rows() if r["id"].startswith(keep) or r["id"].endswith("-ptdp")]
    cases, _ = runs.split_cases(rows)
    assert len(cases) >= 30
    for c in cases:
        if runs.calibration(c.row):
            continue
        pred, unfit = runs.predict(c)
        assert unfit is None, c.row["id"]
        assert abs(pred / c.measured_s - 1) <= 0.15, (c.row["id"], pred, c.measured_s)
