"""The test harness itself: its ranks fork from a server started once, yet each world sees
the environment of the moment it is started, not the server's."""

from shardwise.testing import run_world

PEER = {"overrides": [], "peer": "shardwise.testing.hooks:environment"}


def test_each_world_sees_the_callers_current_environment(monkeypatch):
    seen = []
    for value in ("first", "second"):  # the second world forks from the same server
        monkeypatch.setenv("SHARDWISE_PROBE", value)
        (per_rank,) = run_world(2, [PEER])
        assert [r["env"].get("SHARDWISE_PROBE") for r in per_rank] == [value, value]
        assert [r["env"]["RANK"] for r in per_rank] == ["0", "1"]
        seen += [r["pid"] for r in per_rank]
    assert len(set(seen)) == 4  # fresh rank processes every world
