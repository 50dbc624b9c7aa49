"""The rank's path: the job layer validates a job once, and a rank builds its run from the
run description it is handed (`build_run(cfg, derived)`) without running the checks again.
Ranks that no launcher of ours started (torchrun, srun) run the same checks themselves,
before they join a process group."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwise.cli.main import main
from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.job.prepare import validate
from shardwise.launchers.local import launch_local
from shardwise.training.runtime import build_run

TINY = [
    "--model.name=tiny",
    "--model.n_layers=1",
    "--data.seq_len=32",
    "--train.global_batch=4",
    "--train.steps=2",
    "--train.eval_every=0",
    "--log.tensorboard=false",
    "--log.progress=off",
]
ONE_HELD_OUT = [  # your model, loss and dataset (tests/user/models.py)
    "--model.name=user.models:regressor",
    "--data.dataset=user.models:one_held_out",
    "--train.loss=user.models:summed_mse",
    "--train.eval_every=1",
    "--train.eval_batches=1",
    "--log.tensorboard=false",
]
# where the config's checks live; a Derived's own properties (tokens_per_step) are no check
VALIDATION = (
    "shardwise/training/validate.py",
    "shardwise/training/checks.py",
    "shardwise/training/checks_layout.py",
)
NOT_CHECKS = {"tokens_per_step"}


def _checks_called(fn: Callable[[], object]) -> set[str]:
    """The functions of the validation modules that `fn()` calls (in this thread)."""
    seen: set[str] = set()

    def profile(frame, event, arg) -> None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if event == "call" and path.endswith(VALIDATION):
            seen.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen - NOT_CHECKS


def _losses(run_dir: Path) -> list[float]:
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row)["loss"] for row in rows]


def test_a_rank_trains_from_the_handed_description_without_checking_again(tmp_path):
    """`launch_local(..., derived=)` trains without calling one check (the job layer ran them),
    with the losses of the same job whose rank validated it itself (`validate_here`)."""
    cfg = load_config(None, [*TINY, f"--run.dir={tmp_path / 'handed'}"])
    derived = validate(cfg, 1)
    assert not _checks_called(lambda: launch_local(cfg, 1, derived=derived))
    own = load_config(None, [*TINY, f"--run.dir={tmp_path / 'own'}"])
    # the probe sees the checks where they do run: this test can fail
    assert {"derive", "check_pipeline", "check_held_out"} <= _checks_called(
        lambda: launch_local(own, 1)
    )
    assert len(_losses(tmp_path / "handed")) == 2
    assert _losses(tmp_path / "handed") == _losses(tmp_path / "own")


def test_a_description_for_another_world_is_refused_before_joining(tmp_path):
    """A run description validated for 2 ranks, handed to a rank of a 1-rank world: one
    error naming both sizes, and no process group is started."""
    cfg = load_config(None, [*TINY, f"--run.dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"world of 1 ranks, but its job was validated for 2"):
        build_run(cfg, validate(cfg, 2))
    assert not dist.is_initialized()


def _torchrun_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as rank 0 of 2 that torchrun started; joining a group fails the test."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")

    def joined(*args, **kwargs):
        raise AssertionError("joined a process group")

    monkeypatch.setattr(dist, "init_process_group", joined)


def test_a_torchrun_rank_is_validated_before_it_joins(tmp_path, monkeypatch, capsys):
    """`shardwise train` under torchrun (no launcher of ours): a job invalid for the world
    size is refused by the rank before any process group, and a valid one goes on to join."""
    _torchrun_rank_0(monkeypatch)
    bad = [*TINY, "--train.global_batch=1", f"--run.dir={tmp_path / 'bad'}"]  # 1 rank: valid
    with pytest.raises(SystemExit) as info:
        main(["train", *bad])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error (rank 0): train.global_batch=1 < dp(2)" in err, err
    assert not dist.is_initialized()
    # the data is checked there too: one held-out sample for 2 data-parallel ranks
    with pytest.raises(SystemExit):
        main(["train", *ONE_HELD_OUT, f"--run.dir={tmp_path / 'few'}"])
    assert "has 1 samples, fewer than the 2 data-parallel" in capsys.readouterr().err
    assert not dist.is_initialized()
    with pytest.raises(AssertionError, match="joined a process group"):
        main(["train", *TINY, f"--run.dir={tmp_path / 'good'}"])


def test_plan_verify_validates_each_candidate_once_not_again_in_its_ranks(
    tmp_path, monkeypatch, capsys
):
    """`plan --verify` validates a candidate before its world starts and hands the ranks the
    run description: a verified candidate's rank (run here, in this process, on the harness's
    own path) calls no check. The same case without the description does: the probe works."""
    from shardwise.launchers import harness

    ranks: list[set[str]] = []

    def rank(case: dict, where: Path, out: list[dict]) -> None:
        out.append(harness.run_here(case, str(where)))

    def run_world_here(nproc: int, cases: list[dict]) -> list[list[dict]]:
        assert nproc == 1 and all(c.get("derived") is not None for c in cases)
        results: list[dict] = []
        for i, case in enumerate(cases):
            ranks.append(_checks_called(partial(rank, case, tmp_path / f"case{i}", results)))
            own = {k: v for k, v in case.items() if k != "derived"}
            control = _checks_called(partial(rank, own, tmp_path / f"own{i}", []))
            assert {"derive", "check_held_out"} <= control  # seen where they do run
        return [[r] for r in results]

    monkeypatch.setattr(harness, "run_world", run_world_here)
    argv = ["plan", "--hardware", "cpu", "--devices", "1", "--top", "1", "--verify", *TINY]
    assert main(argv) == 0, capsys.readouterr().err
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("tp1") and "failed" not in row, row
    assert ranks == [set()]
