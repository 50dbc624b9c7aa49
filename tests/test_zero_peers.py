"""Our ZeRO against the peers that implement the same algorithm: PyTorch FSDP2 (`fully_shard`)
for ZeRO-3, and DeepSpeed ZeRO-1/2/3 for each stage (our ZeRO-1/2 against DDP are in
test_zero.py). Same model, data order, seed, AdamW groups, schedule and clipping
(`shardwise.testing.zero_peers`); losses must agree within 1e-5 relative and the final
parameters within 1e-5 absolute.

One spawned world of 2 ranks runs every case (~40-60 s on 2 cores). DeepSpeed is the optional
`bench` extra (`pip install -c constraints.txt -e '.[bench]'`); without it its comparisons are
skipped. With it, DeepSpeed adds ~3 s of start-up, except the first time on a machine: its CPU
communication backend then JIT-compiles a shared-memory op (2.5-4 min on 2 cores) into
`$SHARDWISE_CACHE/torch_extensions`, where later runs find it.
"""

import pytest

from shardwise.testing import run_world
from shardwise.testing.compare import case, max_param_diff, max_rel
from shardwise.testing.zero_peers import deepspeed_available

pytestmark = pytest.mark.slow

PEERS = "shardwise.testing.zero_peers"
INSTALL = "DeepSpeed is the optional 'bench' extra: pip install -c constraints.txt -e '.[bench]'"


def _cases() -> dict:
    """The SMALL run of the parity tests (fp32, 20 steps, clipping active at every step)."""
    cases = {"z3": case("--parallel.zero=3"), "fsdp2": case(peer=f"{PEERS}:fsdp2_peer")}
    if deepspeed_available():
        for stage in (1, 2, 3):
            zero = f"--parallel.zero={stage}"
            cases.setdefault(f"z{stage}", case(zero))
            cases[f"ds{stage}"] = case(zero, peer=f"{PEERS}:deepspeed_peer")
    return cases


@pytest.fixture(scope="module")
def world() -> dict:
    cases = _cases()
    out = {}
    for name, per_rank in zip(cases, run_world(2, list(cases.values())), strict=True):
        for r in per_rank:
            assert "error" not in r, f"{name}: {r['error']}"
        out[name] = per_rank
    return out


def _agree(peer: list[dict], ours: list[dict]) -> None:
    assert len(peer[0]["losses"]) == len(ours[0]["losses"]) == 20
    assert max_rel(peer[0]["losses"], ours[0]["losses"]) <= 1e-5
    assert max_param_diff(peer[0]["params"], ours[0]["params"]) <= 1e-5
    assert max_param_diff(peer[1]["params"], peer[0]["params"]) == 0.0  # one model, gathered


def test_fsdp2_matches_our_zero3(world):
    _agree(world["fsdp2"], world["z3"])


def test_fsdp2_and_ours_hold_zero3_model_states(world):
    """fp32 ZeRO-3: parameters, gradients and both Adam moments sharded, 16Ψ/N in all, in
    FSDP2's tensors as in our accounting (up to shard padding and AdamW's step counters)."""
    psi = sum(p.numel() for p in world["fsdp2"][0]["params"].values())
    ours = world["z3"][0]["records"][-1]["mem_bytes"]
    for r in world["fsdp2"]:
        s = r["state_bytes"]
        assert s["params"] == s["grads"]
        assert abs(s["params"] - 4 * psi / 2) <= 4 * 64
        assert abs(s["optimizer"] - 2 * s["params"]) <= 4 * 64
        for key in ("params", "grads", "master", "optimizer"):
            assert abs(ours[key] - s[key]) <= 4 * 64, key


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_matches_ours(world, stage):
    pytest.importorskip("deepspeed", reason=INSTALL)
    _agree(world[f"ds{stage}"], world[f"z{stage}"])
