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
# imported, or running them
HELPERS = {
    "common.py",
    "smoke_all.py",
    "published_case.py",
    "published_rows.py",
    "published_moe.py",
    "torchtitan_peer.py",
}
# Smoke runs left to `make bench-smoke` (every script), not this suite, to keep it under 15
# minutes on 2 cores: each launches `shardwise train` (fault_soak: a reference, a signalled
# run and its rerun; cpu_malloc: two runs; default_job: the default job, ~10 s), ~40 s of the
# suite, and what they drive is tested here: the signal/restart path and the chaos helper
# (tests/test_preempt.py, tests/test_checkpoint.py), the malloc setting (tests/test_device.py),
# the default job's start, plan line and training (tests/test_default_job.py). Six more
# (7-11 s each) call shardwise only through the test harness (`run_world`,
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
# tests/test_profile.py tests. cuda_speed.py's smoke runs in tests/test_cuda_run.py, through
# benchmarks/cuda_run.sh with the GPU machine's missing packages blocked. data_prepare and
# data_prepare_memory (7-9 s each) run `shardwise data prepare` and `datasets` on a corpus they
# build: the command's streaming, shards, resume and refusals are tests/test_data_prepare*.py's.
ELSEWHERE = {
    "fault_soak.py", "cpu_malloc.py", "default_job.py", "cuda_profile.py",
    "resnet_dp.py", "ddp_vs_torch.py", "checkpoint_async.py",
    "minilm_classify.py", "lora_finetune.py", "grad_compression.py",
    "packing.py", "zero_stages.py", "recompute.py", "tp_vs_dtensor.py",
    "zero_vs_peers.py", "pipeline_bubble.py", "pp_vs_torch.py",
    "soak_kill_saves.py",  # its smoke run is tests/test_checkpoint_safety.py's soak test
    "compile_speed.py",  # compiles through the harness as tests/test_compile.py does
    "cuda_speed.py", "data_prepare.py", "data_prepare_memory.py",
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


def test_a_hidden_injected_cause_is_a_row_of_the_table_not_a_failure(monkeypatch, capsys):
    """On a machine busy enough that the injected cause falls under the report threshold (a
    40 ms data wait in a step slowed to a second), `--verify-remedy` finds no such cause:
    profile_remedies prints that in the cause's row and exits 0 (its smoke run failed the suite
    under load), while any other error still fails it."""
    import importlib.util

    from shardwise.cli import profile as cli_profile
    from shardwise.errors import ShardwiseError

    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("profile_remedies", BENCH / "profile_remedies.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["profile_remedies.py", "--smoke"])
    hidden = "the profile did not find data_wait (it found: cpu_contention, straggler)."

    def not_found(*args, **kwargs):
        raise ShardwiseError(hidden)

    monkeypatch.setattr(cli_profile, "verify", not_found)
    assert bench.main() == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "(round 1)" in line)
    assert row.strip("| ").startswith("data_wait (round 1)") and "did not find data_wait" in row

    def broken(*args, **kwargs):
        raise ShardwiseError("rank(s) [0] failed with exit code(s) [1]")

    monkeypatch.setattr(cli_profile, "verify", broken)
    with pytest.raises(ShardwiseError, match="failed with exit code"):
        bench.main()


# -- the suite's runner: `make test` -----------------------------------------------------------

_FAKE_RUFF = """#!/bin/sh
echo ruff "$@" >> "$CALLS"
case "$1" in format) exit "$RC_FORMAT";; *) exit "$RC_LINT";; esac
"""
# a pytest stand-in: the parallel phase (-n 2) and the serial one each fail their own test
_FAKE_PYTHON = """#!/bin/sh
echo python "$@" >> "$CALLS"
case "$*" in
*"-n 2"*) echo "FAILED tests/test_a.py::test_one - boom"; exit "$RC_PARALLEL";;
*) echo "FAILED tests/test_profile.py::test_two - bang"; exit "$RC_SERIAL";;
esac
"""


def _make_test(tmp_path: Path, **rcs: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`make test PYTEST_ARGS="-k x"` with the repository's Makefile on stand-ins for ruff and
    python that log their calls and exit as told (RC_FORMAT, RC_LINT, RC_PARALLEL, RC_SERIAL)."""
    root = BENCH.parent
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        (tmp_path / name).write_bytes((root / name).read_bytes())
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    for name, text in (("ruff", _FAKE_RUFF), ("python", _FAKE_PYTHON)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    stamp = tmp_path / ".venv" / ".installed"  # installed: newer than its prerequisites
    stamp.write_text("")
    later = (tmp_path / "pyproject.toml").stat().st_mtime + 10
    os.utime(stamp, (later, later))
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    env = {**os.environ, "CALLS": str(calls), **{k: str(v) for k, v in rcs.items()}}
    proc = subprocess.run(
        ["make", "--no-print-directory", "test", "PYTEST_ARGS=-k x"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, calls.read_text().splitlines()


def test_make_test_runs_every_phase_and_fails_at_the_end_with_all_failures(tmp_path):
    """`make test` runs both ruff steps and both pytest phases whatever an earlier one gave
    (it stopped at the first failing line, so a failure in the parallel phase hid the serial
    phase), then names each failing phase and every failed test and exits non-zero; a phase
    that PYTEST_ARGS leaves without tests (pytest's exit 5) passes."""
    proc, calls = _make_test(tmp_path, RC_FORMAT=1, RC_LINT=0, RC_PARALLEL=1, RC_SERIAL=1)
    assert proc.returncode != 0
    assert [c.split()[:2] for c in calls] == [
        ["ruff", "format"],
        ["ruff", "check"],
        ["python", "-u"],
        ["python", "-u"],
    ]
    parallel, serial = calls[2], calls[3]
    assert "-n 2" in parallel and "--ignore=tests/test_profile.py" in parallel
    assert parallel.endswith("-k x") and serial.endswith("tests/test_profile.py -k x")
    summary = proc.stdout[proc.stdout.index("failed phase(s)") :]
    assert "format(exit 1) parallel(exit 1) serial(exit 1)" in summary
    assert "FAILED tests/test_a.py::test_one" in summary
    assert "FAILED tests/test_profile.py::test_two" in summary
    proc, calls = _make_test(tmp_path, RC_FORMAT=0, RC_LINT=0, RC_PARALLEL=5, RC_SERIAL=0)
    assert proc.returncode == 0 and len(calls) == 4, proc.stdout + proc.stderr
    assert "every phase passed" in proc.stdout
