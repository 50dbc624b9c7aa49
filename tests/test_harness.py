"""The test harness itself: its ranks fork from a server started once, yet each world sees
the environment of the moment it is started, not the server's; a failed case names its
cause first; worlds run side by side return each world's results and failures."""

import pytest

from shardwise.launchers.harness import run_named, run_named_worlds, run_world

PEER = {"overrides": [], "peer": "support.hooks:environment"}
BROKEN = {"overrides": [], "peer": "support.hooks:fail_rank1_first"}


def test_each_world_sees_the_callers_current_environment(monkeypatch):
    seen = []
    for value in ("first", "second"):  # the second world forks from the same server
        monkeypatch.setenv("SHARDWISE_PROBE", value)
        (per_rank,) = run_world(2, [PEER])
        assert [r["env"].get("SHARDWISE_PROBE") for r in per_rank] == [value, value]
        assert [r["env"]["RANK"] for r in per_rank] == ["0", "1"]
        seen += [r["pid"] for r in per_rank]
    assert len(set(seen)) == 4  # fresh rank processes every world


def test_a_failed_case_reports_the_cause_before_the_timeouts_it_caused():
    with pytest.raises(AssertionError) as failed:
        run_named(2, {"broken": BROKEN})
    message = str(failed.value)
    assert message.startswith("broken: rank 1: ValueError: the cause, on rank 1")
    assert "rank 0: RuntimeError: Timed out" in message


def test_worlds_side_by_side_return_each_worlds_results_and_failures():
    out = run_named_worlds({1: {"one": PEER}, 2: {"two": PEER}, 3: {"three": PEER}})
    assert sorted(out) == [1, 2, 3]
    assert [len(out[n][name]) for n, name in ((1, "one"), (2, "two"), (3, "three"))] == [1, 2, 3]
    assert [r["env"]["RANK"] for r in out[3]["three"]] == ["0", "1", "2"]
    with pytest.raises(AssertionError) as failed:  # a spawned world's failure reaches the caller
        run_named_worlds({1: {"fine": PEER}, 2: {"broken": BROKEN}})
    assert str(failed.value).startswith("broken: rank 1: ValueError: the cause, on rank 1")
