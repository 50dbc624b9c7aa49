"""A resume that cannot continue in this job (another model's checkpoints in the run dir,
or ones trained with another tokenizer) is refused by the job layer in one line before any
rank starts, with the simple fix (another --run.dir); the ranks' own check stays as the
backstop and is printed by rank 0 alone."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.errors import CheckpointError

SMALL = ["--model.n_layers=1", "--data.seq_len=32", "--train.eval_every=0"]
SAVE = ["--train.steps=2", "--checkpoint.every=2", "--log.tensorboard=false"]


def _no_launch(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record launches instead of starting ranks: a refusal must come before any."""
    from shardwise.launchers import local

    launched: list = []
    monkeypatch.setattr(local, "launch_local", lambda *a, **k: launched.append(a))
    return launched


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def test_another_models_checkpoint_is_refused_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default `tiny` job saved in the run dir; an hf-llama-tiny job on 2 ranks with
    ZeRO-3 in the same run dir is refused by the job layer, naming both models and the fix."""
    run = tmp_path / "run"
    assert main(["train", "--model.name=tiny", *SMALL, *SAVE, f"--run.dir={run}"]) == 0
    capsys.readouterr()
    launched = _no_launch(monkeypatch)
    job = ["--model.name=hf-llama-tiny", *SMALL, "--train.steps=3", "--parallel.zero=3"]
    assert main(["train", *job, f"--run.dir={run}", "--nproc", "2"]) == 2
    line = _one_error(capsys)
    assert not launched
    assert line.startswith("error: checkpoint ") and "step-00000002" in line, line
    for needle in ("model.name='tiny'", "'hf-llama-tiny'", "does not fit this model"):
        assert needle in line, line
    assert line.count("Fix:") == 1 and "--run.dir=<another directory>" in line, line
    assert "--checkpoint.resume=none" not in line  # refused in place: it would overwrite
    # the same model resumes (it reaches the launch)
    assert main(["train", "--model.name=tiny", *SMALL, f"--run.dir={run}", "--nproc", "2"]) == 0
    assert len(launched) == 1


def test_the_ranks_check_is_printed_once(tmp_path: Path) -> None:
    """Past the job layer (the harness builds the run directly), every rank raises the same
    mismatch, marked so that only rank 0 prints it, with the same fix."""
    from shardwise.launchers.harness import run_here

    run = str(tmp_path / "run")
    run_here({"overrides": ["--model.name=tiny", *SMALL, *SAVE]}, run)
    with pytest.raises(CheckpointError) as info:
        run_here({"overrides": ["--model.name=hf-llama-tiny", *SMALL, "--train.steps=3"]}, run)
    assert info.value.every_rank
    assert "--run.dir=<another directory>" in str(info.value)


def _words(path: Path, words: list[str], seed: int) -> None:
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choices(words, k=12)) for _ in range(500)) + "\n")


def test_another_vocabulary_is_refused_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint trained on a.txt (its BPE), resumed on b.txt (another BPE): refused
    before launch in one line naming both data sets and the fix."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    _words(a, ["def", "return", "class", "import", "lambda", "yield", "async", "await"], 0)
    _words(b, ["alpha", "omega", "quartz", "violet", "ember", "harbor", "lantern", "meadow"], 1)
    run, cache = tmp_path / "run", f"--data.cache_dir={tmp_path / 'cache'}"
    common = ["--model.name=tiny", *SMALL, "--data.val_fraction=0", cache, f"--run.dir={run}"]
    assert main(["train", *common, *SAVE, f"--data.dataset={a}"]) == 0
    capsys.readouterr()
    launched = _no_launch(monkeypatch)
    assert main(["train", *common, "--train.steps=4", f"--data.dataset={b}", "--nproc", "2"]) == 2
    line = _one_error(capsys)
    assert not launched
    for needle in (f"data.dataset='{a}'", f"data.dataset='{b}'", "vocabulary differs"):
        assert needle in line, line
    assert line.count("Fix:") == 1 and "--run.dir=<another directory>" in line, line


def test_nothing_to_resume_is_not_checked(tmp_path: Path) -> None:
    """No checkpoint (a fresh run dir) or resume=none: nothing is read."""
    from shardwise.checkpoint.precheck import resume_target
    from shardwise.config import load_config

    cfg = load_config(None, [f"--run.dir={tmp_path / 'fresh'}"])
    assert resume_target(cfg) is None
    cfg = load_config(None, [f"--run.dir={tmp_path}", "--checkpoint.resume=none"])
    assert resume_target(cfg) is None


def test_an_unreadable_latest_is_left_to_the_ranks(tmp_path: Path) -> None:
    """An explicit checkpoint.resume=DIR whose `latest` cannot be read (here bytes that are not
    text) is not the launcher's to judge: no traceback before launch, the ranks say what is
    wrong with it."""
    from shardwise.checkpoint import io
    from shardwise.checkpoint.precheck import resume_target
    from shardwise.config import load_config

    (tmp_path / io.LATEST).write_bytes(b"\xff\xfe\x00step")
    cfg = load_config(None, [f"--run.dir={tmp_path / 'run'}", f"--checkpoint.resume={tmp_path}"])
    assert resume_target(cfg) is None


def test_a_hugging_face_model_directory_is_refused_as_a_resume(tmp_path: Path, capsys) -> None:
    """checkpoint.resume naming a Hugging Face model directory (config.json and safetensors,
    as `shardwise export --format hf` writes) stops before launch with one line naming
    model.init_from, which starts a run from those weights; the directory is left as it was."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    before = sorted(p.name for p in model.iterdir())
    code = main(["train", f"--checkpoint.resume={model}", f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "Hugging Face model directory" in err[0] and f"--model.init_from={model}" in err[0]
    assert sorted(p.name for p in model.iterdir()) == before
