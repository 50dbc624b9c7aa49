"""Every benchmark still runs: each script's `--smoke` mode (the smallest case, a couple of
steps, one round) exits 0 here, so an API change that breaks a benchmark fails the suite
instead of rotting until someone measures. What the benchmarks measure is recorded in
benchmarks/RESULTS.md; a smoke run's numbers mean nothing and draw no verdict."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
HELPERS = {"common.py", "smoke_all.py", "published_rows.py"}  # imported, or running them
# Smoke runs left to `make bench-smoke` (every script), not this suite, to keep it under 15
# minutes on 2 cores: each launches `shardwise train` (fault_soak: a reference, a signalled
# run and its rerun; cpu_malloc: two runs; default_job: the default job, ~10 s), ~40 s of the
# suite, and what they drive is tested here: the signal/restart path and the chaos helper
# (tests/test_preempt.py, tests/test_checkpoint.py), the malloc setting (tests/test_device.py),
# the default job's start, plan line and training (tests/test_default_job.py). Six more
# (7-11 s each) call shardwise only through the test harness (`testing.run_world`,
# `run_here`), which every multi-rank test uses, on what tests run too: ResNet and DDP parity
# (tests/test_parity.py), the async checkpoint (tests/test_checkpoint.py), the MiniLM
# classifier (tests/test_hf_models.py), LoRA (tests/test_lora.py), gradient compression
# (tests/test_compression.py); four more (7-11 s each, the same way) on packing
# (tests/test_packing.py), the ZeRO stages (tests/test_zero.py), recomputation
# (tests/test_parity.py, test_plan_measured.py) and DTensor's tensor parallelism, the peer
# tests/test_tensor.py runs; three of the slowest (13-15 s each): zero_vs_peers (its peers
# run in tests/test_zero_peers.py), pipeline_bubble (the schedules' simulation and our
# pipeline: tests/test_pipeline_units.py, test_pipeline.py) and pp_vs_torch (our pipeline
# against torch.distributed.pipelining, whose side is the benchmark's own). profile_remedies
# stays: it is the one run of `--verify-remedy` here. cuda_profile.py measures on a GPU; its
# CPU smoke (~30 s: a profile, the peer loop, four short trains) drives what
# tests/test_profile.py tests.
ELSEWHERE = {
    "fault_soak.py", "cpu_malloc.py", "default_job.py", "cuda_profile.py",
    "resnet_dp.py", "ddp_vs_torch.py", "checkpoint_async.py",
    "minilm_classify.py", "lora_finetune.py", "grad_compression.py",
    "packing.py", "zero_stages.py", "recompute.py", "tp_vs_dtensor.py",
    "zero_vs_peers.py", "pipeline_bubble.py", "pp_vs_torch.py",
}  # fmt: skip
# the slowest smoke runs first, dealt alternately to the two runners so both finish together
SLOW_FIRST = ["profile_remedies.py", "ledger_overhead.py"]
TIMEOUT_S = 300


def scripts() -> list[str]:
    return sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)


def run_smoke(script: Path, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """`python SCRIPT --smoke` from the repository root, as RESULTS.md's commands run."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(script), "--smoke"],
        cwd=BENCH.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _explain(proc: subprocess.CompletedProcess) -> str:
    out, err = proc.stdout[-3000:], proc.stderr[-3000:]
    return f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


def test_every_benchmark_has_a_smoke_mode():
    for name in scripts():
        assert "add_smoke(" in (BENCH / name).read_text(), (
            f"benchmarks/{name} has no --smoke mode. Fix: call common.add_smoke(parser) and "
            "shrink the run when args.smoke is set."
        )


@pytest.fixture(scope="module")
def smoke_runs() -> dict[str, dict]:
    """Every script's smoke run, in two runner processes side by side (benchmarks/
    smoke_all.py): each runs its scripts one after another in one interpreter, sharing the
    torch import and a warm forkserver for their worlds, which is most of a smoke run's time
    (one process per script took 150 s for 20 scripts, two at a time). No smoke run measures
    anything, so sharing the machine cannot change a verdict."""
    from concurrent.futures import ThreadPoolExecutor

    order = [n for n in SLOW_FIRST if n in scripts() and n not in ELSEWHERE]
    order += [n for n in scripts() if n not in order and n not in ELSEWHERE]
    groups = [order[0::2], order[1::2]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

    def run(group: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(BENCH / "smoke_all.py"), *group],
            cwd=BENCH.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S * len(group),
        )

    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(run, groups))
    out = {}
    for proc in procs:
        for line in proc.stdout.splitlines():
            if line.startswith('{"name": '):
                r = json.loads(line)
                out[r["name"]] = r
        if proc.returncode:
            out.setdefault("(runner)", {"rc": proc.returncode, "stdout": "", "stderr": ""})
            out["(runner)"]["stderr"] += proc.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in scripts() if n not in ELSEWHERE])
def test_benchmark_smoke_runs(smoke_runs, name):
    assert name in smoke_runs, smoke_runs.get("(runner)", "the runner reported nothing")
    r = smoke_runs[name]
    assert r["rc"] == 0, f"exit {r['rc']}\n--- stdout\n{r['stdout']}\n--- stderr\n{r['stderr']}"
    assert r["stdout"].strip(), "a benchmark prints its command and its table"


def test_a_broken_benchmark_call_fails_its_smoke_run(tmp_path):
    """The check can fail: a copy of a benchmark whose call into shardwise no longer fits the
    API (the way zero_vs_peers broke when the optimizer step gained `skip`) exits non-zero."""
    source = (BENCH / "zb_split.py").read_text()
    assert "keep_freed_memory()" in source
    broken = source.replace("keep_freed_memory()", "keep_freed_memory(skip=True)", 1)
    script = tmp_path / "zb_split_broken.py"
    script.write_text(broken)
    env_path = f"{BENCH}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        cwd=BENCH.parent,
        env={**os.environ, "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode != 0
    assert "TypeError" in proc.stderr and "skip" in proc.stderr
