"""The job layer: every entry point (`shardwise train`, `train --nnodes 1`, `shardwise
profile`, `shardwise.train()`) prepares a job through `shardwise.job.prepare`, so each refuses
the same over-memory job and the same disk-full job with the same one-line message, and
`--force` (API: `force=True`) overrides the memory refusal in each of them."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest

import shardwise
from shardwise.cli.main import main
from shardwise.errors import ShardwiseError

TINY = ["--model.name=tiny", "--model.n_layers=1", "--data.seq_len=32", "--train.steps=1"]
ENTRY_POINTS = ("train", "train --nnodes 1", "profile", "shardwise.train()")


def _ram(monkeypatch: pytest.MonkeyPatch, gb: float) -> None:
    """This machine as the planner sees it, with `gb` of RAM (no measurement)."""
    from shardwise.job import auto, explain
    from shardwise.plan.hardware import cpu_hardware

    hw = cpu_hardware(measure=False).with_overrides(memory=int(gb * 1e9))
    monkeypatch.setattr(auto, "detect_hardware", lambda: hw)
    monkeypatch.setattr(explain, "detect_hardware", lambda: hw)


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every disk has 5 MB free: less than one checkpoint of the tiny model."""
    from shardwise.checkpoint import io

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(io.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 5 * 10**6))


def _refusal(entry: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line refusal `entry` gives for the job `args` (it must refuse)."""
    if entry == "shardwise.train()":
        overrides = [a for a in args if a.startswith("--") and a != "--force"]
        with pytest.raises(ShardwiseError) as caught:
            shardwise.train(None, overrides=overrides, nproc=1, force="--force" in args)
        return str(caught.value)
    command = {"train": ["train"], "train --nnodes 1": ["train", "--nnodes", "1"]}
    argv = [*command.get(entry, ["profile", "--steps", "1"]), *args, "--nproc", "1"]
    assert main(argv) == 2, f"{entry} did not refuse"
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0].removeprefix("error: ")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_refuses_the_over_memory_job_alike(
    entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A job the plan says needs more RAM than the machine has is refused, within 30 s, by
    each entry point with the message `shardwise train` gives, and nothing is trained."""
    _ram(monkeypatch, 0.001)
    job = [*TINY, f"--run.dir={tmp_path / 'run'}"]
    expected = _refusal("train", job, capsys)
    assert "run out of memory" in expected and "--force" in expected
    start = time.monotonic()
    got = _refusal(entry, job, capsys)
    assert time.monotonic() - start < 30, f"{entry} took over 30 s to refuse"
    assert got == expected
    assert not list(tmp_path.rglob("metrics.jsonl"))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_refuses_the_disk_full_job_alike(
    entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A job whose first checkpoint cannot fit on the disk is refused before step 1 by each
    entry point with the same message (the profile names its own checkpoint folder). With
    --force the memory refusal is skipped and the disk check still holds, in every one."""
    _full_disk(monkeypatch)
    run = tmp_path / "run"
    job = [*TINY, "--checkpoint.every=1", f"--run.dir={run}"]
    expected = _refusal("train", job, capsys)
    assert "the first save would fill the disk" in expected
    got = _refusal(entry, job, capsys)
    assert got.replace(str(run / "profile"), str(run)) == expected
    _ram(monkeypatch, 0.001)  # too big as well: --force gets past memory, not past the disk
    forced = _refusal(entry, [*job, "--force"], capsys)
    assert forced.replace(str(run / "profile"), str(run)) == expected
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_force_starts_the_over_memory_job_from_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shardwise.train(..., force=True)` trains the job the plan refused."""
    _ram(monkeypatch, 0.001)
    job = [*TINY, f"--run.dir={tmp_path}", "--log.progress=off", "--log.tensorboard=false"]
    with pytest.raises(ShardwiseError, match="run out of memory"):
        shardwise.train(None, overrides=job, nproc=1)
    records = shardwise.train(None, overrides=job, nproc=1, force=True)
    assert [r["step"] for r in records] == [1]


def test_max_restarts_is_checked_by_one_function_for_train_and_nnodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--max-restarts` is validated the same way with and without --nnodes."""
    for value in ("-1", "x", "2"):
        messages = []
        for extra in ([], ["--nnodes", "1"]):
            argv = ["train", *TINY, f"--run.dir={tmp_path}", "--max-restarts", value, *extra]
            assert main(argv) == 2
            messages.append(capsys.readouterr().err.strip().splitlines()[-1])
        assert messages[0] == messages[1], messages
