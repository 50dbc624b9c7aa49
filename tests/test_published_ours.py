"""Our own GPU runs as rows of the published record (benchmarks/published/): what
benchmarks/cuda_profile.py and cuda_speed.py write with --row, and how the record prices and
calibrates with them."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.plan import gpu
from support.bench import bench_module


@pytest.fixture(scope="module")
def runs():
    return bench_module("published_runs")


def test_a_gpu_run_of_ours_is_written_as_a_row_the_record_reads(runs, monkeypatch):
    """`benchmarks/cuda_profile.py --row` writes the run in the record's own format: on an
    H200 it names the catalog's card, and the record prices it as a calibration row."""
    import argparse

    from shardwise.plan import hardware

    cuda_profile = bench_module("cuda_profile")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware, "detect_hardware", lambda: hardware.get_hardware("h200"))
    a = argparse.Namespace(
        model="125m", seq=1024, micro=8, global_batch=16, precision="bf16", steps=5, warmup=2
    )
    cells = ["shardwise (measured)", "81.0", "40.0%", "12.00 GiB"]
    row = cuda_profile.published_row(a, 0.081, 0.4, 12 * 2**30, "NVIDIA H200", cells)
    assert row["id"] == "shardwise-h200-125m-1g-s1024-mb8"
    assert row["measured"] == {
        "step_time_s": 0.081, "mem_gib_per_gpu": 12.0, "mem_counts": "allocated", "mfu": 0.4
    }  # fmt: skip
    row = json.loads(json.dumps(row))  # as the file holds it
    cases, skipped = runs.split_cases([row])
    assert not skipped and runs.calibration(row)
    (case,) = cases
    assert case.measured_s == 0.081 and case.job.hardware.name == "h200"
    assert case.layout.micro_batch == 8 and case.job.global_batch == 16
    assert runs.stated_memory(cases)[0][1:3] == ("allocated", 12.0)


def test_compiled_and_fp8_runs_of_ours_are_rows_that_say_so(runs, monkeypatch, tmp_path):
    """`benchmarks/cuda_speed.py --row` writes its eager, compiled and FP8 runs of one config
    under ids of their own, each layout naming what ran (`compile`, `float8`), and the record
    prices each so: the same config compiled is a different job (a row priced as eager would
    be compared with the wrong prediction), FP8 at the card's FP8 peak."""
    import argparse

    from shardwise.distributed import device as dev
    from shardwise.plan import hardware

    cuda_speed = bench_module("cuda_speed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware, "detect_hardware", lambda: hardware.get_hardware("h200"))
    h200 = dev.DeviceInfo("cuda", "nccl", torch.device("cpu"), "NVIDIA H200")
    monkeypatch.setattr(dev, "detect", lambda *_: h200)
    a = argparse.Namespace(
        model="125m", seq=1024, micro=8, global_batch=16, precision="bf16", steps=5, warmup=2,
        row=tmp_path / "published.jsonl",
    )  # fmt: skip
    results = cuda_speed.Results(tmp_path, {}, [])
    measured = {"status": "measured", "mfu": 0.4, "peak_bytes": 2**30, "breaks": 0}
    for name, compile_, fp8, step in (
        ("eager", "false", "none", 0.09), ("compiled blocks", "blocks", "none", 0.08),
        ("compiled + FP8 tensorwise", "blocks", "tensorwise", 0.07),
    ):  # fmt: skip
        run = cuda_speed.Run(name, "ours", compile_, fp8)
        results.add(run, {**measured, "step_s": step, "wall_s": 1.0, "estimate_s": 1.0})
    cuda_speed.publish(a, results)
    rows = [json.loads(line) for line in a.row.read_text().splitlines()]
    base = "shardwise-h200-125m-1g-s1024-mb8"
    assert [r["id"] for r in rows] == [base, f"{base}-compiled", f"{base}-compiled-fp8tensorwise"]
    assert [(r["layout"].get("compile"), r["layout"].get("float8")) for r in rows] == [
        (None, None), (True, None), (True, "tensorwise")
    ]  # fmt: skip
    cases, skipped = runs.split_cases(rows)
    assert not skipped
    assert [(c.job.compiled, c.job.fp8) for c in cases] == [
        (False, "none"), (True, "none"), (True, "tensorwise")
    ]  # fmt: skip
    # only the eager run calibrates: the others are priced from it, not fitted to
    assert [runs.calibration(r) for r in rows] == [True, False, False]
    hw = cases[2].job.hardware
    assert gpu.linear_peak(hw, cases[2].job) == hw.peak["fp8"] > hw.peak["bf16"]
    eager, compiled, fp8 = (runs.predict(c)[0] for c in cases)
    assert compiled < eager and fp8 < eager


def test_calibrating_leaves_cards_without_a_fit_as_the_catalog_has_them(runs):
    """`published_runs.py --calibrate` fits the chips that have calibration rows and prices
    every row with them; a card whose chip has none (the B200 rows) keeps its catalog entry
    instead of stopping the run."""
    cases, _ = runs.split_cases(runs.load_rows())
    b200 = next(c for c in cases if c.job.hardware.name == "b200")
    h100 = next(c for c in cases if c.job.hardware.name == "h100-sxm")
    params = {"h100": {"matmul_eff": 0.5}}
    assert runs.with_params(b200, params) is b200
    assert runs.with_params(h100, params).job.hardware.matmul_eff == 0.5
