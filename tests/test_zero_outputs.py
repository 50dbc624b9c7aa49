"""ZeRO-3 gathers a unit's parameters for backward on the gradient of its output tensors, so
it must find them: in a dataclass a block returns (trained as ZeRO-0 trains it), and where it
cannot (a plain object), the run stops at the first forward naming the unit and the fix,
instead of running backward on freed parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.launchers.harness import run_here
from support.compare import VOCAB, max_param_diff, max_rel

USER = Path(__file__).resolve().parent / "user" / "models.py"
LM = [f"--model.vocab_size={VOCAB}", "--data.seq_len=32", "--train.global_batch=4"]
STEPS = ["--train.steps=4", "--train.eval_every=0", "--train.eval_batches=0", "--optim.eps=1e-6"]


def _run(tmp: Path, name: str, *overrides: str) -> dict:
    overrides = [f"--model.name={USER}:{name}", *LM, *STEPS, *overrides]
    return run_here({"overrides": overrides}, str(tmp))


def test_dataclass_outputs_train_under_zero3_as_under_zero0(tmp_path: Path) -> None:
    """Same losses and parameters as ZeRO-0 (one rank: the same sums, in other buffers)."""
    plain = _run(tmp_path / "z0", "dataclass_blocks")
    zero3 = _run(tmp_path / "z3", "dataclass_blocks", "--parallel.zero=3")
    assert "error" not in zero3, zero3.get("error")
    assert len(zero3["losses"]) == 4
    assert max_rel(zero3["losses"], plain["losses"]) <= 1e-6
    assert max_param_diff(zero3["params"], plain["params"]) <= 1e-6


def test_an_opaque_output_is_refused_under_zero3(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"ZeRO-3: unit 'blocks\.0' returned a _Wrapped.*Fix:"):
        _run(tmp_path / "z3", "opaque_blocks", "--parallel.zero=3")
