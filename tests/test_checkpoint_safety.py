"""Checkpoint safety: a job deletes and overwrites only what it wrote, never loses its last good
checkpoint, follows the line of saves it continues, and finds an unusable checkpoint.dir (in
use, unwritable, links planted at names a save writes) before its first step.

Each run is the real training loop on the small decoder, one rank in this process
(`run_here`), saving every 2 steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.checkpoint import io, lineage
from shardwise.config import load_config
from shardwise.errors import CheckpointError, ConfigError
from shardwise.launchers.harness import run_here
from shardwise.training.lock import acquire, release
from support.compare import case

EVERY = "--checkpoint.every=2"
ROOT = Path(__file__).resolve().parents[1]


def _run(run_dir: Path, steps: int, *extra: str) -> dict:
    return run_here(case(f"--train.steps={steps}", EVERY, *extra), str(run_dir))


def _steps_in(root: Path) -> list[int]:
    return sorted(s for s, _ in io.list_complete(root))


def _valid(path: Path) -> bool:
    index, problems = io.check_index(path)
    return not problems and not io.check_files(path, index["files"])


# -- pruning ------------------------------------------------------------------------------------
def test_pruning_deletes_only_the_checkpoints_own_files(tmp_path, capsys):
    """A user's file inside a step directory survives pruning: only the files the checkpoint's
    index lists are deleted, the directory stays with the user's file, and that is said once."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    _run(run_dir, 4)
    notes = root / "step-00000002" / "notes.txt"
    notes.write_text("x\n")
    capsys.readouterr()
    _run(run_dir, 6, "--checkpoint.keep=1")
    err = capsys.readouterr().err
    assert notes.read_text() == "x\n"
    assert sorted(p.name for p in notes.parent.iterdir()) == ["notes.txt"]
    assert not (root / "step-00000004").exists()  # nothing of the user's there: removed whole
    assert _steps_in(root) == [6] and _valid(root / "step-00000006")
    assert err.count("notes.txt") == 1 and "deleted its own files only" in err, err


def test_a_damaged_newer_checkpoint_never_costs_the_last_good_one(tmp_path):
    """keep=1 with a damaged step-00000010 (a step past the run's): pruning counts only
    checkpoints that verify, on the line of the save, so the new save stays, `latest` names it,
    and the damaged one is left alone."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    _run(run_dir, 4)
    damaged = shutil.copytree(root / "step-00000004", root / "step-00000010")
    shard = damaged / io.shard_name(0)
    shard.write_bytes(shard.read_bytes()[:100])
    got = _run(run_dir, 6, "--checkpoint.keep=1")
    assert [r["step"] for r in got["records"]] == [5, 6]  # from `latest` (4), not step 10
    newest = io.latest(root)
    assert newest is not None and newest.name == "step-00000006" and _valid(newest)
    assert _steps_in(root) == [6, 10]  # the damaged one is off the line: not pruned


def test_a_damaged_checkpoint_does_not_count_toward_keep(tmp_path):
    """The choice itself: with the newest checkpoint of the line failing verification, keep=1
    deletes nothing older (one verified checkpoint always stays)."""
    root = tmp_path / "c"
    history = [{"run": "a", "from": 0}]
    for step in (2, 4):
        path = io.step_dir(root, step)
        path.mkdir(parents=True)
        index = {"format": io.FORMAT, "version": io.VERSION, "step": step, "files": {}}
        (path / io.INDEX).write_text(json.dumps({**index, lineage.HISTORY: history}))
    good = {"step-00000004": False, "step-00000002": True}
    doomed = lineage.doomed(root, history, 4, 1, lambda e: good[e.path.name])
    assert doomed == []
    good["step-00000004"] = True
    assert [e.step for e in lineage.doomed(root, history, 4, 1, lambda e: good[e.path.name])] == [2]


# -- the line of saves --------------------------------------------------------------------------
def test_resume_auto_follows_latest_after_a_rollback(tmp_path, capsys):
    """A run rolled back to step 2 (saving 3 and 5 beside the abandoned 4 and 6): a later
    resume=auto continues step 5, the newest save, not the abandoned step 6; the abandoned
    checkpoints are neither loaded nor pruned."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    _run(run_dir, 6)
    back = f"--checkpoint.resume={root / 'step-00000002'}"
    _run(run_dir, 5, "--checkpoint.every=3", back)
    assert io.latest(root).name == "step-00000005"
    capsys.readouterr()
    got = _run(run_dir, 7, "--checkpoint.every=7")
    err = capsys.readouterr().err
    assert [r["step"] for r in got["records"]] == [6, 7]
    assert "step-00000004, step-00000006" in err and "off the line" in err, err
    assert {4, 6, 7} <= set(_steps_in(root))


def test_a_save_never_lands_on_another_lines_valid_checkpoint(tmp_path):
    """Rolled back to step 2 with every=2, the run would save step 4 over the abandoned line's
    step 4: refused before the first step, nothing changed."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    _run(run_dir, 6)
    before = (root / "step-00000004" / io.INDEX).read_bytes()
    with pytest.raises(CheckpointError, match=r"would save over step-00000004.* Fix: "):
        _run(run_dir, 6, f"--checkpoint.resume={root / 'step-00000002'}")
    assert (root / "step-00000004" / io.INDEX).read_bytes() == before


def test_a_fresh_run_in_a_used_run_dir_is_refused_before_it_starts(tmp_path):
    """resume=none with the default every=0 still saves on a stop signal, over the older run's
    checkpoint of that step: refused at once, naming the directory and the fix."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    _run(run_dir, 4)
    # (the lock file names whoever holds the directory now: each job rewrites it)
    saved = [p for p in root.rglob("*") if p.is_file() and p.name != ".shardwise.lock"]
    before = {p: p.read_bytes() for p in saved}
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError) as info:
        run_here(case("--train.steps=4", "--checkpoint.resume=none"), str(run_dir))
    msg = str(info.value)
    assert str(root) in msg and "--checkpoint.resume=auto" in msg and "--run.dir" in msg, msg
    after = [p for p in root.rglob("*") if p.is_file() and p.name != ".shardwise.lock"]
    assert {p: p.read_bytes() for p in after} == before
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


def test_the_stop_hint_names_the_resume_that_works():
    """A stopped job says how to resume it: with resume=auto, whatever this job was given
    (a resume=none job run the same way again would be refused)."""
    from shardwise.training.preempt import Preempted

    msg = str(Preempted(15, 4, "/x/step-00000004"))
    assert "--checkpoint.resume=auto" in msg, msg


# -- the directories ----------------------------------------------------------------------------
def test_a_second_job_on_another_jobs_default_checkpoint_dir_is_refused(tmp_path):
    """Job B pointing its checkpoint.dir at job A's default run.dir/checkpoints is refused at
    once, naming A as the holder."""
    a = acquire(load_config(None, [f"--run.dir={tmp_path / 'a'}"]))
    try:
        b = [f"--run.dir={tmp_path / 'b'}", f"--checkpoint.dir={tmp_path / 'a' / 'checkpoints'}"]
        with pytest.raises(ConfigError, match=rf"checkpoint.dir=.* is in use .*pid {os.getpid()}"):
            acquire(load_config(None, [*b, EVERY]))
    finally:
        release(a)


def test_an_unwritable_checkpoint_dir_is_refused_before_the_first_step(tmp_path):
    """run.dir/checkpoints is a file (as root, chmod does not stop writes; a file does): the
    job stops before any step with one message naming checkpoint.dir and the fix."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a directory\n")
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*checkpoints cannot be written.*Fix"):
        _run(run_dir, 2)
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_users_lock_file_in_run_dir_is_never_touched(tmp_path):
    """`--run.dir=$HOME` with a `~/.lock` of the user's: the job's lock has its own name."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".lock").write_text("my lock\n")
    release(acquire(load_config(None, [f"--run.dir={home}"])))
    assert (home / ".lock").read_text() == "my lock\n"
    (home / ".shardwise.lock").write_text("someone's notes\n")
    with pytest.raises(ConfigError, match="left as it is"):
        acquire(load_config(None, [f"--run.dir={home}"]))
    assert (home / ".shardwise.lock").read_text() == "someone's notes\n"


@pytest.mark.parametrize("name", ["latest.tmp", "step-00000002.tmp", ".shardwise.lock", ".lock"])
def test_a_planted_link_is_never_written_through(tmp_path, name):
    """A symbolic link at a name a save (or the lock) writes, pointing outside: the file it
    points to is never written; the job is refused before its first step, naming the link
    (a `.lock` is not a name of ours: the job runs and leaves it alone)."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    root.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "file").write_text("theirs\n")
    target = outside if name.endswith(".tmp") and name.startswith("step") else outside / "file"
    where = run_dir if "lock" in name else root
    (where / name).symlink_to(target)
    if name == ".lock":
        _run(run_dir, 2)
    else:
        with pytest.raises((CheckpointError, ConfigError), match="symbolic link"):
            _run(run_dir, 2)
        assert not (run_dir / "metrics.jsonl").exists()
    assert sorted(p.name for p in outside.iterdir()) == ["file"]
    assert (outside / "file").read_text() == "theirs\n"


def test_a_users_directory_at_a_saves_temporary_name_is_left_alone(tmp_path):
    """A real `step-00000002.tmp` holding a user's file (not a save's): the save of step 2
    would write its shards into it and rename it into a checkpoint; refused before the
    first step instead, with the user's file where it was."""
    run_dir = tmp_path / "run"
    theirs = run_dir / "checkpoints" / "step-00000002.tmp"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("keep me\n")
    with pytest.raises(CheckpointError, match=r"step-00000002\.tmp is in the way.*Fix: "):
        _run(run_dir, 2)
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]
    assert not (run_dir / "checkpoints" / "step-00000002").exists()


def test_a_save_never_writes_through_a_link_made_during_the_run(tmp_path):
    """The write itself: a file is only ever created new (a link there makes it fail), and a
    `latest.tmp` not of ours is refused, not followed."""
    outside = tmp_path / "outside"
    outside.write_text("theirs\n")
    link = tmp_path / "x"
    link.symlink_to(outside)
    with pytest.raises(FileExistsError):
        io.write_file(link, b"data")
    (tmp_path / "latest.tmp").symlink_to(outside)
    with pytest.raises(CheckpointError, match="symbolic link"):
        io.check_pointer(tmp_path)
    assert outside.read_text() == "theirs\n"


# -- disk space ---------------------------------------------------------------------------------
def test_the_room_check_counts_every_checkpoint_alive_at_once(tmp_path):
    """keep=3 saving every 2 of 8 steps: 4 checkpoints are on disk at once (3 kept, one being
    written), so room for 2.5 of them is refused before launch."""
    cfg = load_config(None, [f"--run.dir={tmp_path}", EVERY, "--train.steps=8"])
    copies = lineage.alive_at_once(cfg)
    assert copies == 4
    need = shutil.disk_usage(tmp_path).free // 3
    with pytest.raises(CheckpointError, match=r"4 of them are on disk at once.*Fix: "):
        io.check_room(tmp_path, need, "checkpoint.dir", copies)
    io.check_room(tmp_path, need, "checkpoint.dir")  # one fits


def test_a_full_disk_is_reported_once_naming_the_dir(tmp_path):
    """Every rank failing the same way makes one clause, not one per rank."""
    from shardwise.checkpoint.saving import raise_failed

    tmp = io.step_dir(tmp_path, 4).with_suffix(".tmp")
    report = f"writing {tmp}: No space left on device"
    with pytest.raises(CheckpointError) as info:
        raise_failed(tmp_path, 4, [report, report])
    msg = str(info.value)
    assert msg.count("No space left on device") == 1 and msg.count("Fix:") == 1, msg
    assert "ranks 0, 1" in msg and str(tmp_path) in msg, msg
    assert info.value.every_rank  # every rank raises it alike: only rank 0 prints it


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_failure_every_rank_shares_is_printed_by_rank_0_alone(monkeypatch, capsys, rank):
    """A rank's entry point prints a failed save's message on rank 0 only (each rank used to
    print the same line), and every rank still exits 2."""
    from shardwise.launchers import local

    def fails(cfg, hook=None, derived=None):
        exc = CheckpointError("saving step 4 failed (rank 0 writing x: No space left on device)")
        exc.every_rank = True
        raise exc

    monkeypatch.setattr(local, "train_here", fails)
    monkeypatch.setattr(local, "config_from_dict", lambda d: d)
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as info:
        local.rank_main({})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("No space left on device") == (1 if rank == "0" else 0), err


def test_a_full_disk_on_two_ranks_prints_one_error_line_and_no_launcher_line(tmp_path):
    """Two ranks whose second save hits a full disk: the job exits 2 with the save's message
    printed once (rank 0) and no launcher line after it ("rank(s) [0, 1] failed ...") that
    would bury the fix under noise; the first checkpoint is kept."""
    from support.compare import SMALL

    run_dir = tmp_path / "run"
    args = [*SMALL, "--train.steps=3", "--checkpoint.every=1", "--log.tensorboard=false"]
    args += ["--log.progress=off", "--run.device=cpu", f"--run.dir={run_dir}"]
    hook = "support.hooks:disk_full_at_second_save"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "support.faultjob", hook, "2", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    err = done.stderr
    assert done.returncode == 2, err
    assert err.count("No space left on device") == 1 and "Fix:" in err, err
    assert "failed with exit code" not in err and "Traceback" not in err, err
    assert io.latest(run_dir / "checkpoints").name == "step-00000001"


# -- the soak -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_whole_job_kills_during_saves_leave_a_verified_checkpoint(tmp_path):
    """benchmarks/soak_kill_saves.py --smoke: the whole job SIGKILLed during saves 3 times
    (keep=1), then run to the end: a verified checkpoint of the last step, the user's files
    untouched."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    script = ROOT / "benchmarks" / "soak_kill_saves.py"
    cmd = [sys.executable, str(script), "--smoke", "--dir", str(tmp_path / "soak")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "survived: verified" in proc.stdout, proc.stdout[-3000:]
