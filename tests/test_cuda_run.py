"""The GPU run kit works on the first try: benchmarks/cuda_run.sh, rehearsed on CPU in an
interpreter that lacks what the GPU machine lacks (tests/support/device_site blocks those
packages: torchao, datasets, bitsandbytes, ...), leaves every result file in $OUT, the FP8
rows skipped in one line that says why; cuda_speed.py's budget skips what would not fit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "tests" / "support" / "device_site"
FILES = {"env.txt", "cuda_speed.log", "cuda_speed.jsonl", "cuda_speed.md", "cuda_profile.log"}


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(SITE), str(ROOT / "src"), str(ROOT / "tests")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def test_the_device_site_hides_the_missing_packages_and_shardwise_still_imports():
    """The rehearsal's premise: a blocked package is absent to imports, `find_spec` and its
    metadata alike, while shardwise's CLI and training modules import without it."""
    probe = (
        "import importlib.util as u, importlib.metadata as m\n"
        "assert u.find_spec('torchao') is None and u.find_spec('datasets') is None\n"
        "try:\n    m.version('datasets')\nexcept m.PackageNotFoundError:\n    pass\n"
        "else:\n    raise SystemExit('datasets metadata visible')\n"
        "try:\n    import bitsandbytes\nexcept ModuleNotFoundError:\n    pass\n"
        "else:\n    raise SystemExit('bitsandbytes imported')\n"
        "import shardwise.cli.main, shardwise.training.runtime, shardwise.parallel.fp8 as f\n"
        "assert not f.torchao_installed()\n"
        "assert u.find_spec('numpy') is not None\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_cuda_run_smoke_leaves_every_result_in_out_without_torchao(tmp_path):
    """`bash benchmarks/cuda_run.sh --smoke` as on the GPU machine (its missing packages
    blocked): exit 0, every file in $OUT (at most 8 come back), the runs in their order, and
    the FP8 row skipped in one line naming torchao; the scripts' run folders removed from the
    temporary directory (a machine that runs them often would fill up)."""
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    env = _env(OUT=str(out), PYTHON=sys.executable, CUDA_RUN_SITE=str(tmp_path / "site"))
    env["TMPDIR"] = str(scratch)
    proc = subprocess.run(
        ["bash", "benchmarks/cuda_run.sh", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    names = {p.name for p in out.iterdir()}
    # (torch's compile cache, shared by every torch process, may be created there)
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert FILES | {"published.jsonl"} == names and len(names) <= 8
    env_txt = (out / "env.txt").read_text()
    assert "torchao missing" in env_txt and "datasets missing" in env_txt
    rows = [json.loads(line) for line in (out / "cuda_speed.jsonl").read_text().splitlines()]
    order = [r["run"] for r in rows]
    assert order[:4] == [
        "eager",
        "compiled blocks",
        "PyTorch AMP (peer)",
        "planner (explain, eager)",
    ]
    mine = [r for r in rows if "FP8" not in r["run"] and "torchtitan" not in r["run"]]
    assert all(r["status"] == "measured" for r in mine), rows
    # each run of ours has the planner's step for its own keys beside it
    measured = [r for r in rows if r["status"] == "measured"]
    ours = [r for r in measured if "AMP" not in r["run"] and "planner" not in r["run"]]
    assert len(ours) == 3 and all(r["plan_s"] > 0 for r in ours), rows
    assert "planner ms (/ step)" in (out / "cuda_speed.md").read_text()
    fp8 = [r for r in rows if "FP8" in r["run"]]
    assert fp8 and all(r["status"] == "skipped" for r in fp8)
    assert [r["run"] for r in rows if "Llama-3" in r["run"]] == order[-2:]
    skipped = [x for x in (out / "cuda_speed.md").read_text().splitlines() if "skipped" in x]
    assert len(skipped) == 2 and all(line.startswith("skipped: ") for line in skipped)
    assert skipped[0] == (
        "skipped: torchtitan: eager: torchtitan not installed"
        " (benchmarks/gpu_wheels.sh fetches 0.3.0)"
    )
    assert "torchao missing" in skipped[1] and all(r["run"] in skipped[1] for r in fp8)
    assert "| eager " in (out / "cuda_speed.log").read_text()
    assert "| PyTorch AMP (peer)" in (out / "cuda_profile.log").read_text()
    published = [json.loads(line) for line in (out / "published.jsonl").read_text().splitlines()]
    sources = [row["source"] for row in published]
    assert any("cuda_speed.py (eager)" in s for s in sources), sources
    compiled = [r for r in published if "(compiled blocks)" in r["source"]]
    assert [(r["id"].endswith("-compiled"), r["layout"]["compile"]) for r in compiled] == [
        (True, True)
    ]
    assert any("cuda_profile.py" in s for s in sources), sources


def test_cuda_speed_skips_what_does_not_fit_its_budget(tmp_path):
    """With no time left every run is skipped, each saying its estimate and the budget, and
    the script still writes its files and exits 0 (a skip is no failure)."""
    cmd = [sys.executable, "benchmarks/cuda_speed.py", "--smoke", "--budget-s", "0"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)],
        cwd=ROOT,
        env=_env(SHARDWISE_BLOCK_MODULES="torchtitan"),  # torchao importable: FP8 is planned
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "cuda_speed.jsonl").read_text().splitlines()]
    assert len(rows) >= 8 and all(r["status"] == "skipped" for r in rows), rows
    # torchtitan, not installed here, says so first; every other run names the budget
    titan = [r for r in rows if r["run"].startswith("torchtitan")]
    assert [r["reason"] for r in titan] == [
        "torchtitan not installed (benchmarks/gpu_wheels.sh fetches 0.3.0)"
    ]
    assert all("left of --budget-s 0" in r["reason"] for r in rows if r not in titan), rows
    assert "FP8" in rows[5]["run"]
    skipped = [x for x in (tmp_path / "cuda_speed.md").read_text().splitlines() if "skipped" in x]
    budget = [x for x in skipped if "torchtitan not installed" not in x]
    assert len(budget) == len(skipped) - 1 and all("left of --budget-s 0" in x for x in budget)


def test_a_failed_run_is_a_row_and_the_next_run_still_starts(monkeypatch, tmp_path):
    """On a borrowed GPU one broken run must not cost the rest: a `shardwise train` or a
    torchtitan process that exits non-zero, a peer that raises and a planner that exits each
    become a failed row with its reason, every later run still starts, and the Llama-3 peer is
    skipped (its own run failed); after a failed torchtitan row the next torchtitan row is
    skipped (it would fail alike: the smoke plans one, so the full plan is run too)."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import cuda_speed

    started = []

    def broken_cli(args, timeout, program=()):
        started.append(Path(program[0]).name if program else args[0])
        return 2, "error: boom"

    def broken_peer(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    def broken_plan(*args, **kwargs):
        raise SystemExit("shardwise explain failed (1)")

    monkeypatch.setattr(cuda_speed, "stream_cli", broken_cli)
    monkeypatch.setattr(cuda_speed, "peer", broken_peer)
    monkeypatch.setattr(cuda_speed, "predicted", broken_plan)
    monkeypatch.setattr(cuda_speed, "fp8_unavailable", lambda smoke: "")
    monkeypatch.setattr(cuda_speed.torchtitan_peer, "unavailable", lambda: "")
    a = argparse.Namespace(
        model="tiny", seq=64, micro=2, global_batch=4, precision="bf16", steps=2, warmup=1,
        llama3_layers=1, smoke=True, budget_s=1e6,
    )  # fmt: skip
    results = cuda_speed.Results(tmp_path, {False: 0.0, True: 0.0}, [])
    cuda_speed.run_all(a, tmp_path, results, {False: 1.0, True: 1.0})
    status = {run.name: r["status"] for run, r in results.rows}
    # eager, compiled, torchtitan, FP8, the Llama-3 shape: each one started
    assert started == ["train", "train", "torchtitan_peer.py", "train", "train"]
    assert list(status.values()).count("failed") == 7, status
    assert list(status.values())[-1] == "skipped"
    md = (tmp_path / "cuda_speed.md").read_text()
    assert "shardwise train exited 2: error: boom" in md and "CUDA out of memory" in md
    assert "shardwise explain failed (1)" in md and "has no result to compare" in md
    assert "torchtitan_peer.py exited 2: error: boom" in md
    started.clear()
    a.smoke, a.llama3_layers = False, 0
    full = cuda_speed.Results(tmp_path, {False: 0.0}, [])
    monkeypatch.setattr(cuda_speed, "estimate_s", lambda *args: 1.0)
    cuda_speed.run_all(a, tmp_path, full, {False: 1.0})
    titan = [(run.name, r.get("reason", "")) for run, r in full.rows if run.kind == "titan"]
    assert [name for name, _ in titan] == [
        "torchtitan: compiled blocks",
        "torchtitan: eager",
        "torchtitan: compiled + FP8 rowwise",
    ]
    assert "exited 2" in titan[0][1]
    assert [reason for _, reason in titan[1:]] == [
        "an earlier torchtitan row failed (its reason is above)"
    ] * 2
    assert started.count("torchtitan_peer.py") == 1


def test_the_llama3_shape_runs_eager_with_its_peer_then_compiled_and_with_fp8(monkeypatch):
    """The trimmed Llama-3-8B shape is measured as the 1b preset is: eager beside its own AMP
    peer (the pair first, so a short budget keeps the ratio), then compiled blocks and
    compiled FP8 tensorwise; --smoke keeps the pair only (a CPU's compile of it says
    nothing)."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import cuda_speed

    for smoke, want in (
        (False, ["eager", "PyTorch AMP (peer)", "compiled blocks", "compiled + FP8 tensorwise"]),
        (True, ["eager", "PyTorch AMP (peer)"]),
    ):
        runs = cuda_speed.plan_runs(argparse.Namespace(smoke=smoke, llama3_layers=8))
        assert [r.name.split(": ")[-1] for r in runs if r.llama3] == want


def test_torchtitan_rows_come_after_the_bf16_table_and_say_how_they_compare(monkeypatch):
    """torchtitan's rows are planned right after the bf16 table (compiled first: the pair
    the speed goal compares) and its FP8 after ours; each measured torchtitan row is set
    beside our run of the same compile and FP8 as a ratio of steps."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import cuda_speed

    runs = cuda_speed.plan_runs(argparse.Namespace(smoke=False, llama3_layers=0))
    names = [r.name for r in runs]
    assert names[4:6] == ["torchtitan: compiled blocks", "torchtitan: eager"]
    assert names.index("torchtitan: compiled + FP8 rowwise") > names.index("compiled + FP8 rowwise")
    smoke = cuda_speed.plan_runs(argparse.Namespace(smoke=True, llama3_layers=0))
    assert [r.name for r in smoke if r.kind == "titan"] == ["torchtitan: eager"]
    results = cuda_speed.Results(Path("/nonexistent"), {}, [])
    step = {"compiled blocks": 0.30, "torchtitan: compiled blocks": 0.32, "eager": 0.37}
    step["torchtitan: eager"] = 0.40
    by_name = {r.name: r for r in runs}
    results.rows = [(by_name[n], {"status": "measured", "step_s": s}) for n, s in step.items()]
    assert results.against_torchtitan() == [
        "compiled blocks / torchtitan: compiled blocks: 0.938",
        "eager / torchtitan: eager: 0.925",
    ]


def test_torchtitan_of_another_release_is_refused_by_name(monkeypatch):
    """torchtitan_peer.py builds with one release's model-config API: another installed
    release (or none) is a skipped row that names the version found and the one wanted."""
    import importlib.metadata

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import torchtitan_peer

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    assert torchtitan_peer.unavailable() == (
        "torchtitan not installed (benchmarks/gpu_wheels.sh fetches 0.3.0)"
    )
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.2.0")
    assert torchtitan_peer.unavailable() == (
        "torchtitan 0.2.0 installed; this script builds with 0.3.0's model API"
    )


def test_torchtitan_on_an_older_torch_runs_with_a_stand_in_or_is_skipped(monkeypatch):
    """torchtitan 0.3.0 imports one FSDP type that torch 2.11 (the GPU machine's) lacks: on
    2.11 a stand-in class takes the name and each row says so below the table; an older torch
    is one skipped line naming the torch it needs and the one found, not three failed imports
    (the release found and its package stand in for an installed one); a precision other
    than bf16, which its mixed precision is, is skipped before any of it."""
    import argparse
    import importlib.metadata
    import importlib.util

    import torch.distributed.fsdp as fsdp

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import cuda_speed
    import torchtitan_peer

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.0")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    assert torchtitan_peer.unavailable() == (
        "torchtitan 0.3.0 needs torch >= 2.12 (its FSDP code imports "
        "torch.distributed.fsdp.DataParallelMeshDims; 2.11 runs it with a stand-in); "
        "this torch is 2.10.0+cu128"
    )
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert torchtitan_peer.unavailable() == ""
    note = torchtitan_peer.stand_in()
    assert isinstance(fsdp.DataParallelMeshDims, type)
    assert note.startswith("torchtitan 0.3.0 on torch 2.11.0+cu130, older than the 2.12")
    assert torchtitan_peer.stand_in() == ""  # the name is there now: nothing stands in again
    results = cuda_speed.Results(Path("/nonexistent"), {}, [])
    rows = [("torchtitan: eager", "titan"), ("eager", "ours")]
    results.rows = [(cuda_speed.Run(n, k), {"status": "measured", "step_s": 0.4}) for n, k in rows]
    results.rows[0][1]["note"] = note
    assert results.against_torchtitan() == ["eager / torchtitan: eager: 1.000", note]
    run = cuda_speed.Run("torchtitan: eager", "titan")
    a = argparse.Namespace(precision="fp32", budget_s=1e6)
    why = cuda_speed.skip_reason(a, run, 1.0, 1e6, "", [])
    assert why == "torchtitan rows train in bf16 (its mixed precision), not fp32"


@pytest.mark.slow
def test_the_peer_trains_another_implementation_of_the_same_widths_only(monkeypatch, tmp_path):
    """The peer's `build` hook (how torchtitan's model enters its loop): a model of the same
    parameter count trains in the peer's loop; one of another count is refused by its
    numbers, so a row never compares different models."""
    import argparse

    from shardwise.models import build_model

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import cuda_profile

    a = argparse.Namespace(
        model="tiny", seq=64, micro=2, global_batch=4, precision="bf16", warmup=1
    )  # fmt: skip
    r = cuda_profile.peer(a, tmp_path, 2, build=lambda spec, seq, device: build_model(spec))
    assert r["step_s"] > 0 and r["device"] == "cpu"
    with pytest.raises(ValueError, match=r"the peer's model holds 16 parameters, ours 1,787,008"):
        cuda_profile.peer(a, tmp_path, 2, build=lambda spec, seq, device: torch.nn.Linear(3, 4))
