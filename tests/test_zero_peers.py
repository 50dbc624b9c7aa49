"""Our ZeRO against the peers that implement the same algorithm: PyTorch FSDP2 (`fully_shard`)
for ZeRO-3, and DeepSpeed ZeRO-1/2/3 for each stage (our ZeRO-1/2 against DDP are in
test_zero.py). Same model, data order, seed, AdamW groups, schedule and clipping
(`support.zero_peers`); losses must agree within 1e-5 relative and the final
parameters within 1e-5 absolute.

One spawned world of 2 ranks runs every case (~40-60 s on 2 cores). DeepSpeed is the optional
`bench` extra (`pip install -c constraints.txt -e '.[bench]'`); without it its comparisons are
skipped. With it, DeepSpeed adds ~3 s of start-up, except the first time on a machine: its CPU
communication backend then JIT-compiles a shared-memory op (2.5-4 min on 2 cores) into
`$SHARDWISE_CACHE/torch_extensions`, where later runs find it.
"""

import pytest

from shardwise.launchers.harness import run_world
from support.compare import SMALL, case, max_param_diff, max_rel
from support.zero_peers import DEEPSPEED_INSTALL as INSTALL
from support.zero_peers import deepspeed_available

pytestmark = pytest.mark.slow

PEERS = "support.zero_peers"


def _cases() -> dict:
    """The SMALL run of the parity tests (fp32, 20 steps, clipping active at every step)."""
    cases = {"z3": case("--parallel.zero=3"), "fsdp2": case(peer=f"{PEERS}:fsdp2_peer")}
    if deepspeed_available():
        for stage in (1, 2, 3):
            zero = f"--parallel.zero={stage}"
            cases.setdefault(f"z{stage}", case(zero))
            cases[f"ds{stage}"] = case(zero, peer=f"{PEERS}:deepspeed_peer")
        for stage in (1, 2):  # bf16: what its optimizer step allocates (BLOOM's engine)
            bf16 = (f"--parallel.zero={stage}", "--precision.compute=bf16")
            cases[f"ds{stage}_bf16"] = case(*bf16, peer=f"{PEERS}:deepspeed_peer")
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


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_step_allocates_as_planned(world, stage):
    """DeepSpeed's ZeRO-1/2 optimizer step flattens the rank's share of the 16-bit gradients
    and casts it to fp32 (the planner's `peers.Deviations.step_grad_copies`, with which it prices
    BLOOM's pre-BF16-optimizer runs): measured at the dispatcher, byte for byte up to
    DeepSpeed's alignment of a group to 2 x dp elements. Today's DeepSpeed steps one param
    group at a time, freeing a group's copies before the next: the peak is the matrices'
    group, the planner's share less the vectors (norm weights, biases) of the no-decay group."""
    pytest.importorskip("deepspeed", reason=INSTALL)
    from shardwise.config import load_config
    from shardwise.job.predict import job_from_config, layout_from_config
    from shardwise.plan import memory as mem
    from shardwise.plan.hardware import get_hardware
    from shardwise.plan.peers import Deviations, run_by
    from shardwise.training.validate import derive

    cfg = load_config(None, [*SMALL, f"--parallel.zero={stage}", "--precision.compute=bf16"])
    d = derive(cfg, 2)
    job = job_from_config(cfg, get_hardware("a100-80gb"), 2)
    job = run_by(job, Deviations("deepspeed", step_grad_copies=True))
    lay = layout_from_config(cfg, d)
    predicted = mem.step_copies(job, lay, mem.stage_units(job, lay, 0))
    assert predicted > 0
    vectors = sum(t.numel() for t in world[f"ds{stage}_bf16"][0]["params"].values() if t.ndim < 2)
    assert 0 < vectors < predicted / 100
    for r in world[f"ds{stage}_bf16"]:
        got = r["state_bytes"]["step_alloc"]
        assert abs(got - (predicted - (2 + 4) * vectors / 2)) <= (2 + 4) * 4, (got, predicted)
