"""support/compare.py's `assert_reproduces`, which every layout-parity test relies on: it passes
on a rank that matches its reference, and fails, naming the case, rank, quantity and worst
difference, on each way a rank can differ."""

from __future__ import annotations

import math

import pytest
import torch

from support.compare import assert_reproduces, max_param_diff, max_rel, worst_tensor


def _run(losses: list[float], norms: list[float], params: dict) -> dict:
    return {"losses": losses, "records": [{"grad_norm": g} for g in norms], "params": params}


def _ref() -> dict:
    params = {"a": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([[0.5, 0.25]])}
    return _run([2.0, 1.5, 1.0], [0.3, 0.2, 0.1], params)


def _copy(run: dict) -> dict:
    norms = [r["grad_norm"] for r in run["records"]]
    return _run(list(run["losses"]), norms, {k: v.clone() for k, v in run["params"].items()})


def test_a_matching_rank_passes():
    ref, near = _ref(), _copy(_ref())
    near["losses"][1] *= 1 + 5e-6  # within 1e-5 relative
    near["params"]["a"][0] += 5e-6
    assert_reproduces("same", [_copy(ref), near], ref)
    halves = [{**_copy(ref), "params": {k: ref["params"][k]}} for k in ("a", "b")]
    assert_reproduces("stages", halves, ref, sharded=True)


@pytest.mark.parametrize(
    ("change", "options", "needle"),
    [
        (lambda r: r["losses"].__setitem__(2, 1.0001), {}, "case rank 1: losses differ by 0.0001"),
        (lambda r: r["records"][0].update(grad_norm=0.31), {}, "grad norms differ by 0.0333"),
        (lambda r: r["params"]["b"][0, 1].add_(2e-5), {}, "parameter b differs by 2e-05 abs"),
        (lambda r: r["params"]["a"].mul_(1.001), {"rel_l2": True}, "parameter a differs by 0.001"),
        (lambda r: r["params"].pop("b"), {}, "parameter names differ from the reference's: ['b']"),
        (lambda r: r["params"]["a"].fill_(float("nan")), {}, "parameter a differs by nan"),
        (lambda r: r["losses"].pop(), {}, "case rank 1: 2 losses, the reference 3"),
        (lambda r: r["losses"].__setitem__(1, float("nan")), {}, "losses differ by nan"),
    ],
)
def test_each_difference_fails_naming_it(change, options, needle):
    ref, bad = _ref(), _copy(_ref())
    change(bad)
    with pytest.raises(AssertionError) as err:
        assert_reproduces("case", [_copy(ref), bad], ref, **options)
    assert needle in str(err.value), str(err.value)


def test_sharded_ranks_must_cover_the_model_and_grad_norms_can_be_skipped():
    ref = _ref()
    only_a = {**_copy(ref), "params": {"a": ref["params"]["a"]}}
    with pytest.raises(AssertionError, match=r"stages: no rank holds parameters \['b'\]"):
        assert_reproduces("stages", [only_a], ref, sharded=True)
    resumed = _copy(ref)
    resumed["records"][0]["grad_norm"] = 9.0
    assert_reproduces("resumed", [resumed], ref, grad_norms=False)
    assert worst_tensor(resumed["params"], ref["params"]) == (0.0, "a")


def test_the_two_distances_do_not_pass_over_a_nan():
    """A NaN anywhere makes the distance NaN, which fails every `<= tol` (Python's `max`
    keeps the first of two values when the second is NaN)."""
    assert math.isnan(max_rel([1.0, float("nan")], [1.0, 1.0]))
    ref = _ref()["params"]
    bad = {k: v.clone() for k, v in ref.items()}
    bad["b"][0, 0] = float("nan")
    assert math.isnan(max_param_diff(bad, ref))
    bad["a"][1] += 1.0
    assert math.isnan(max_param_diff(bad, ref))
