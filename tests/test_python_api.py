"""The Python entry point: `shardwise.train(config, model=..., dataset=...,
loss=..., nproc=...)` trains your module on your data with your loss, in any layout, and the
README's complete example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardwise
from shardwise.errors import ConfigError, DataError
from support.compare import max_rel
from user.models import bad_items, regressor, summed_mse, waves

README = Path(__file__).resolve().parents[1] / "docs" / "models.md"  # the python-api example
CONFIG = {
    "train": {"steps": 6, "global_batch": 16, "lr": 1e-2, "eval_every": 3, "eval_batches": 2},
    "optim": {"warmup_steps": 1, "eps": 1e-6},
    "log": {"progress": "off", "tensorboard": False},
}


def _train(tmp_path: Path, name: str, nproc: int, *extra: str, dataset=waves) -> list[dict]:
    return shardwise.train(
        CONFIG,
        model=regressor,
        dataset=dataset,
        loss=summed_mse,
        nproc=nproc,
        overrides=[f"--run.dir={tmp_path / name}", *extra],
    )


@pytest.mark.slow
def test_your_model_data_and_loss_train_alike_on_one_and_two_ranks(tmp_path):
    one = _train(tmp_path, "one", 1)
    two = _train(tmp_path, "z3", 2, "--parallel.zero=3")
    assert [r["step"] for r in one] == list(range(1, 7))
    assert one[-1]["loss"] < one[0]["loss"], "it trained"
    assert max_rel([r["loss"] for r in two], [r["loss"] for r in one]) <= 1e-5
    # the held-out split from the same factory; a regression has no accuracy
    evals = [r for r in one if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6] and "eval_accuracy" not in evals[0]
    assert abs(two[-1]["eval_loss"] - one[-1]["eval_loss"]) <= 1e-5 * one[-1]["eval_loss"]


def test_what_cannot_reach_the_other_ranks_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"lambda or a function defined inside another"):
        shardwise.train(CONFIG, model=lambda: regressor(), nproc=1)
    with pytest.raises(ConfigError, match=r"is not a TOML path, a mapping or a Config"):
        shardwise.train(42, model=regressor)
    with pytest.raises(ConfigError, match=r"train.loss='mse' is neither"):
        shardwise.train(CONFIG, model=regressor, dataset=waves, loss="mse", nproc=1)


def test_bad_items_are_one_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"not an \(input, target\) pair"):
        _train(tmp_path, "bad", 1, dataset=bad_items)


def _readme_example() -> str:
    text = README.read_text()
    block = re.search(r"<!-- python-api:start -->\n```python\n(.*?)```", text, re.S)
    assert block, "README lacks the python-api example"
    return block.group(1)


@pytest.mark.slow
def test_the_readmes_example_runs_as_written(tmp_path):
    script = tmp_path / "train_mine.py"
    script.write_text(_readme_example())
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("final loss"), proc.stdout[-2000:]
    assert (tmp_path / "runs" / "mine" / "metrics.jsonl").exists()


def test_a_held_out_split_smaller_than_dp_is_refused_before_launch(tmp_path):
    """Not a crash at the first evaluation (global_batch=0) hours in."""
    from user.models import one_held_out

    with pytest.raises(ConfigError, match=r"has 1 samples, fewer than the 2 data-parallel"):
        _train(tmp_path, "r", 2, dataset=one_held_out)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
