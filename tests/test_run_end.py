"""How a run ends: a resumed run keeps its final state, a finished job says it has nothing to
do, TensorBoard curves are kept apart per run as metrics.jsonl is, the last line says what was
written where, a stop says only what it saved, a full run.dir gives one message and never half
a record, and the plan header says what trains and how."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.checkpoint import io as cio
from shardwise.cli.main import main
from shardwise.config import load_config
from shardwise.launchers.local import train_here
from shardwise.training.preempt import Preempted
from support.compare import SMALL

pytestmark = pytest.mark.slow

QUIET = ["--log.progress=off", "--log.every=1000000"]


def _args(run_dir: Path, *extra: str) -> list[str]:
    return [*SMALL, "--log.tensorboard=false", *QUIET, f"--run.dir={run_dir}", *extra]


def _train(capsys: pytest.CaptureFixture[str], run_dir: Path, *extra: str) -> tuple[int, str]:
    """`shardwise train --nproc 1` in this process: (exit status, stdout + stderr); the last
    line is stdout's (stderr's notes come before it on a terminal)."""
    code = main(["train", "--nproc", "1", *_args(run_dir, *extra)])
    out = capsys.readouterr()
    return code, out.err + out.out


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def ctrl_c_in_step_2(run) -> None:
    """Fault hook: SIGINT to this process while step 2 runs (as Ctrl-C would)."""
    step, calls = run.optimizer.step, []

    def stepped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return step(*args, **kwargs)

    run.optimizer.step = stepped


def test_a_resumed_run_saves_its_final_step_without_checkpoint_every(tmp_path, capsys):
    """checkpoint.every=0: Ctrl-C saves step 2; the rerun resumes and must save its final step
    4, or the next identical command would resume step 2 again and retrain the tail (and
    export would take step 2). Run once more, the job is complete and says so, exit 0, its
    files untouched. Each end names what it wrote where."""
    run_dir = tmp_path / "run"
    args = _args(run_dir, "--train.steps=4", "--checkpoint.every=0")
    with pytest.raises(Preempted) as stopped:
        train_here(load_config(None, args), f"{__name__}:ctrl_c_in_step_2")
    saved = cio.step_dir(run_dir / "checkpoints", 2)
    assert stopped.value.code == 130 and cio.latest(run_dir / "checkpoints") == saved

    code, out = _train(capsys, run_dir, "--train.steps=4", "--checkpoint.every=0")
    assert code == 0, out
    final = cio.step_dir(run_dir / "checkpoints", 4)
    assert cio.latest(run_dir / "checkpoints") == final
    assert _steps(run_dir / "metrics.jsonl") == [1, 2, 3, 4]
    last = out.strip().splitlines()[-1]
    assert last.startswith("shardwise: done at step 4/4"), out
    assert f"run dir {run_dir}" in last and f"metrics {run_dir / 'metrics.jsonl'}" in last
    assert f"checkpoint {final}" in last

    def records() -> dict[str, bytes]:  # (not the job lock, which names its holder)
        return {p.name: p.read_bytes() for p in run_dir.glob("*.json*")}

    before = records()
    code, out = _train(capsys, run_dir, "--train.steps=4", "--checkpoint.every=0")
    assert code == 0, out
    assert "already complete at step 4: nothing to do" in out.strip().splitlines()[-1], out
    assert records() == before and "metrics.jsonl" in before
    assert main(["export", str(run_dir), "--format", "hf", str(tmp_path / "hf")]) == 0
    assert f"exported {final}" in capsys.readouterr().out
    # the stop's own report: what it saved where
    assert f"checkpoint saved in {saved}" in str(stopped.value)
    assert f"metrics in {run_dir / 'metrics.jsonl'}" in str(stopped.value)


def test_a_fresh_run_without_checkpoints_says_its_final_state_is_not_kept(tmp_path, capsys):
    """Nothing to resume and checkpoint.every=0: the last line names the run dir and metrics
    and says no checkpoint holds the final state, with the option that keeps it."""
    run_dir = tmp_path / "run"
    code, out = _train(capsys, run_dir, "--train.steps=2")
    assert code == 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("shardwise: done at step 2/2"), out
    assert f"run dir {run_dir}" in last and "no checkpoint saved" in last
    assert "--checkpoint.every=N" in last
    assert not list(run_dir.glob("checkpoints/step-*"))


def test_a_checkpoint_past_train_steps_is_refused_with_the_fix(tmp_path, capsys):
    """A checkpoint at step 4 resumed with train.steps=2 has nothing to train: one message
    with both fixes and a failing status, not a silent success."""
    run_dir = tmp_path / "run"
    assert _train(capsys, run_dir, "--train.steps=4", "--checkpoint.every=2")[0] == 0
    code, out = _train(capsys, run_dir, "--train.steps=2", "--checkpoint.every=2")
    assert code == 2, out
    assert "at step 4, past train.steps=2: nothing to train" in out
    assert "--train.steps=N with N > 4" in out and "a new --run.dir" in out
    assert _steps(run_dir / "metrics.jsonl") == [1, 2, 3, 4]


def _tb_steps(folder: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars("train/loss")]


def test_tensorboard_is_rotated_with_metrics_and_kept_on_resume(tmp_path, capsys):
    """A fresh run in a used run.dir keeps the earlier run's tb/ as tb.1 (never one curve
    stacked on another's steps); a resumed run continues its own tb/."""
    run_dir = tmp_path / "run"
    tb = ["--log.tensorboard=true"]
    assert _train(capsys, run_dir, "--train.steps=2", *tb)[0] == 0
    code, out = _train(capsys, run_dir, "--train.steps=2", "--checkpoint.every=2", *tb)
    assert code == 0, out
    assert "tb held an earlier run's records: kept as tb.1" in out
    assert _tb_steps(run_dir / "tb.1") == [1, 2] and _tb_steps(run_dir / "tb") == [1, 2]
    code, out = _train(capsys, run_dir, "--train.steps=4", "--checkpoint.every=2", *tb)
    assert code == 0, out
    assert not (run_dir / "tb.2").exists() and not (run_dir / "metrics.2.jsonl").exists()
    assert _tb_steps(run_dir / "tb") == [1, 2, 3, 4]
    assert f"tensorboard {run_dir / 'tb'}" in out.strip().splitlines()[-1]


def test_a_stop_before_any_save_does_not_claim_a_checkpoint(tmp_path):
    """The launcher's report of ranks stopped by a signal: a checkpoint counts as saved only
    if this job committed it; none at all, or an earlier job's, is said as such."""
    from shardwise.launchers.local import _stopped

    cfg = load_config(None, _args(tmp_path / "run"))
    nothing = _stopped(cfg, signal.SIGTERM, time.time())
    assert not nothing.saved and nothing.code == 143
    assert "checkpoint saved" not in str(nothing)
    assert "before any checkpoint was saved" in str(nothing)

    ckpt = cio.step_dir(tmp_path / "run" / "checkpoints", 3)
    ckpt.mkdir(parents=True)
    (ckpt / cio.INDEX).write_text("{}")
    (ckpt.parent / cio.LATEST).write_text(ckpt.name)
    older = _stopped(cfg, signal.SIGTERM, time.time() + 60)  # committed before the job began
    assert not older.saved and "checkpoint saved" not in str(older)
    assert f"resumes from the newest earlier one, {ckpt} (step 3)" in str(older)
    now = _stopped(cfg, signal.SIGTERM, time.time() - 60)
    assert now.saved and f"after step 3: checkpoint saved in {ckpt}" in str(now)


@pytest.mark.parametrize("has_checkpoint", [False, True])
def test_an_abort_on_a_second_signal_says_what_is_left(
    tmp_path, monkeypatch, capsys, has_checkpoint
):
    """A second SIGTERM aborts without saving: it names the newest complete checkpoint, or
    says there is none (not "the last complete checkpoint stays valid" when none exists)."""
    from shardwise.training import preempt

    root = tmp_path / "checkpoints"
    if has_checkpoint:
        cio.step_dir(root, 2).mkdir(parents=True)
        (root / cio.LATEST).write_text("step-00000002")

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(preempt, "SAME_REQUEST_S", -1.0)  # the second one is a new request
    monkeypatch.setattr(preempt.os, "_exit", exit_)
    stop = preempt.StopRequest(root)
    stop._handle(signal.SIGTERM, None)
    with pytest.raises(SystemExit) as aborted:
        stop._handle(signal.SIGTERM, None)
    assert aborted.value.code == 143
    err = capsys.readouterr().err
    assert "aborting at once without saving" in err
    if has_checkpoint:
        assert f"the newest complete checkpoint, {cio.step_dir(root, 2)}, stays valid" in err
    else:
        assert "no checkpoint was saved" in err and "stays valid" not in err


def _limit_file_size(limit: int):
    def apply() -> None:  # a file grows past `limit` bytes: EFBIG, as a full disk gives ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_full_run_dir_gives_one_message_and_never_half_a_record(tmp_path):
    """Records that no longer fit in run.dir (here: a file-size limit, cut mid-record): one
    line naming metrics.jsonl and the fix, no traceback, and every line left in the file is a
    whole record."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    # config.json fits; metrics.jsonl (a record is > 400 bytes) outgrows the limit mid-record
    limit = len(json.dumps(load_config(None, _args(run_dir)).to_dict(), indent=2)) + 3000
    cmd = [sys.executable, "-m", "shardwise.cli.main", "train", "--nproc", "1"]
    cmd += _args(run_dir, f"--train.steps={limit // 400}")
    proc = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit_file_size(limit),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(error) == 1, proc.stderr[-3000:]
    assert f"writing {run_dir / 'metrics.jsonl'} failed" in error[0]
    assert f"Fix: free space in (or make writable) {run_dir}" in error[0]
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n") and 0 < len(text) <= limit
    assert _steps(run_dir / "metrics.jsonl") == list(range(1, len(text.splitlines()) + 1))


def test_a_half_record_left_by_a_kill_is_dropped_with_a_note(tmp_path, capsys):
    """A resumed run meets a metrics.jsonl ending in half a line (from a job killed mid-write):
    it drops that line and says so, and the file holds whole records only."""
    run_dir = tmp_path / "run"
    assert _train(capsys, run_dir, "--train.steps=2", "--checkpoint.every=2")[0] == 0
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 6.1')
    code, out = _train(capsys, run_dir, "--train.steps=3", "--checkpoint.every=2")
    assert code == 0, out
    assert f"{run_dir / 'metrics.jsonl'}: dropped an incomplete last line" in out
    assert _steps(run_dir / "metrics.jsonl") == [1, 2, 3]


def test_the_header_says_what_trains_and_how(tmp_path, capsys):
    """QLoRA with an 8-bit optimizer: the plan line and `explain` (text and --json) give the
    trainable, frozen and quantised counts of the model as training builds it, the LoRA rank,
    alpha and targets, the base format and the optimizer with its state's dtype."""
    import torch

    from shardwise.finetune.lora import apply_lora, is_lora_layer
    from shardwise.models import build_model
    from shardwise.training.validate import derive

    lora = [
        "--finetune.lora_rank=4",
        "--finetune.lora_targets=wq,wv",
        "--finetune.base_quant=nf4",
        "--optim.name=adamw8bit",
    ]
    cfg = load_config(None, _args(tmp_path / "run", *lora))
    with torch.device("meta"):
        model = build_model(derive(cfg, 1).spec)
        apply_lora(model, cfg.finetune)
    adapters = [m for m in model.modules() if is_lora_layer(m)]
    quantised = sum(m.base_layer.weight.numel() for m in adapters)
    params = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad) - quantised

    assert main(["explain", "--nproc", "1", "--json", *_args(tmp_path / "run", *lora)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["trainable_params"], r["frozen_params"]) == (trainable, frozen)
    assert r["quantised_params"] == quantised and r["base_quant"] == "nf4"
    assert r["params"] == trainable + frozen + quantised
    assert r["lora"] == {"rank": 4, "alpha": 16.0, "targets": "wq,wv", "layers": len(adapters)}
    assert (r["optimizer"], r["optimizer_state_dtype"]) == ("adamw8bit", "int8")

    assert main(["explain", "--nproc", "1", *_args(tmp_path / "run", *lora)]) == 0
    text = capsys.readouterr().out
    assert f"{trainable:,} / {frozen:,} / {quantised:,}" in text
    assert f"r=4 alpha=16 on wq,wv ({len(adapters)} layers)" in text
    assert "adamw8bit (state int8" in text

    code, out = _train(capsys, tmp_path / "run", *lora, "--train.steps=1")
    assert code == 0, out
    plan = [line for line in out.splitlines() if line.startswith("shardwise: tiny (")]
    assert len(plan) == 1 and "trainable" in plan[0] and "quantised nf4" in plan[0], out
    assert "shardwise: optimizer adamw8bit (state int8" in out
    assert f"LoRA r=4 alpha=16 on wq,wv ({len(adapters)} layers)" in out


def test_a_classification_run_counts_rows_not_tokens(tmp_path, capsys):
    """An image classifier's sample is one row: its plan counts rows per step and its log line
    rows/s, not tokens."""
    args = [
        "--model.name=resnet18",
        "--data.dataset=digits",
        "--data.image_size=8",
        "--train.global_batch=8",
        "--train.steps=1",
        "--train.eval_batches=0",
        "--log.tensorboard=false",
        "--log.progress=off",
        f"--run.dir={tmp_path / 'run'}",
    ]
    assert main(["train", "--nproc", "1", *args]) == 0
    out = capsys.readouterr().out
    step = [line for line in out.splitlines() if line.startswith("step 1/1")]
    assert len(step) == 1 and "rows/s" in step[0] and "tok/s" not in step[0], out
    assert "8 rows/step" in out and "tokens/step" not in out


def test_a_run_ending_in_an_error_keeps_its_tensorboard_curve(tmp_path):
    """A run that ends in an error (its second save hits a full disk) has the TensorBoard events
    of every step it logged, as metrics.jsonl has them: the loop closes the buffering writer on
    the error path too, rather than leave it to the process's exit."""
    run_dir = tmp_path / "run"
    args = [*SMALL, *QUIET, "--train.steps=3", "--checkpoint.every=1", f"--run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "support.faultjob", "support.hooks:disk_full_at_second_save"]
    done = subprocess.run([*cmd, "1", *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2 and "No space left on device" in done.stderr, done.stderr
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert logged and _tb_steps(run_dir / "tb") == logged
