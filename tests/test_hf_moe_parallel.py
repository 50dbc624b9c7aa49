"""Pipeline and tensor (+ sequence) parallelism of Hugging Face MoE checkpoints
(`model.name=hf`), alone and with expert parallelism, in fp32 on the tiny checkpoints of
tests/test_hf_moe.py (2 layers, 4 experts, top-2):

- pp: transformers' Qwen2-MoE (with its shared expert), OLMoE and Mixtral classes cut into
  stages as transformers' Llama is (the embedding, the decoder layers, the final norm and head;
  OLMoE publishes no `base_model_pp_plan` and is cut by Llama's), 1F1B: pp 2 on 2 ranks, ep 2 x
  pp 2 on 4 ranks;
- tp + sp: Qwen2-MoE and Mixtral, attention split by the published plan, the router and
  experts whole on every tp rank, each routing its own sequence shard: tp 2 + sp on 2 ranks,
  ep 2 x tp 2 + sp on 4 ranks.

Each must reproduce one process's losses, gradient norms, parameters and expert loads, and
explain must price their model states exactly (OLMoE's tp plan and tp without sp are refused:
tests/test_hf_moe.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from shardwise.config import load_config
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_named_worlds
from shardwise.plan.hardware import get_hardware
from support.compare import assert_reproduces
from test_hf_moe import STEPS, _lm, world  # noqa: F401 (the checkpoints' fixture)

pytestmark = pytest.mark.slow

PP2 = ["--parallel.pp=2", "--train.micro_batch=2"]  # 1F1B (the default schedule)
TP2 = ["--parallel.tp=2", "--parallel.sp=true"]
EP2 = ["--parallel.ep=2"]
CASES = {  # name: (checkpoint, world size, extra overrides)
    "qwen2_moe_pp2": ("qwen2_moe", 2, PP2),
    "olmoe_pp2": ("olmoe", 2, PP2),
    "mixtral_pp2": ("mixtral", 2, PP2),
    "qwen2_moe_ep2_pp2": ("qwen2_moe", 4, [*PP2, *EP2]),
    "olmoe_ep2_pp2": ("olmoe", 4, [*PP2, *EP2]),
    "qwen2_moe_tp2": ("qwen2_moe", 2, TP2),
    "mixtral_tp2": ("mixtral", 2, TP2),
    "qwen2_moe_ep2_tp2": ("qwen2_moe", 4, [*TP2, *EP2]),
    "mixtral_ep2_tp2": ("mixtral", 4, [*TP2, *EP2]),
}
STATES = ("params", "grads", "master", "optimizer")


@pytest.fixture(scope="module")
def runs(world):  # noqa: F811
    worlds: dict[int, dict] = {1: {}, 2: {}, 4: {}}
    for name, (ckpt, size, extra) in CASES.items():
        worlds[1][ckpt] = {"overrides": _lm(world, ckpt, *STEPS)}
        worlds[size][name] = {"overrides": _lm(world, ckpt, *STEPS, *extra)}
    return run_named_worlds(worlds)


def _dims(name: str) -> list[str]:
    """The mesh dimensions case `name` splits beside dp."""
    return [d for d in ("pp", "tp", "ep") if f"{d}2" in name]


@pytest.mark.parametrize("name", list(CASES))
def test_layouts_reproduce_one_process(runs, name):
    """fp32: losses and gradient norms within 1e-5 relative every step, and each rank's
    parameters (its stage's, gathered over tp and ep) within 1e-5 of one process's after 4 AdamW
    steps, together all of them. Only the order of sums differs from one process (each dp
    rank's tokens, each ep rank's experts, the tp shards' partial products and the routers'
    and experts' gradients summed over the sequence shards), in the last bits of fp32 (~1e-7
    relative); 1e-5 leaves Adam's per-coordinate division room (tests/support/compare.py). The
    expert loads are counts summed over every micro-batch, rank, stage and sequence shard: the
    same numbers, on every rank."""
    ckpt, size, _ = CASES[name]
    one, ranks = runs[1][ckpt][0], runs[size][name]
    assert len(ranks) == size and one["losses"][-1] < one["losses"][0]
    assert_reproduces(name, ranks, one, sharded=True)
    loads = [r["moe_load_max_mean"] for r in one["records"]]
    assert all(len(x) == 2 for x in loads)  # both MoE layers, whichever stage holds them
    for rank in ranks:
        assert [r["moe_load_max_mean"] for r in rank["records"]] == loads
        for dim in _dims(name):
            assert rank["records"][-1]["comm_bytes"][dim] > 0, dim


@pytest.mark.parametrize("name", list(CASES))
def test_explain_prices_the_layout(world, runs, name):  # noqa: F811
    """explain cuts and splits the meta model as training does: rank 0's params, grads, master
    and optimizer bytes and buffers equal the measured ones, its activations and total within
    5 % (docs/moe.md's bound for our MoE decoder; a fake forward at balanced routing), its pp
    and tp bytes and calls equal rank 0's, and with ep its ep calls (5 per MoE layer of the
    stage and micro-batch, whatever the routing)."""
    ckpt, size, extra = CASES[name]
    cfg = load_config(None, _lm(world, ckpt, *STEPS, *extra))
    pred = explain_record(cfg, size, get_hardware("cpu", calibrate=False))
    got = runs[size][name][0]["records"][-1]
    for key in (*STATES, "buffers"):
        assert pred["mem_bytes"][key] == got["mem_bytes"][key], (key, pred, got)
    for key in ("activations", "total"):
        assert abs(pred["mem_bytes"][key] - got["mem_bytes"][key]) <= 0.05 * got["mem_bytes"][key]
    for dim in _dims(name):
        if dim != "ep":
            assert pred["comm_bytes"][dim] == got["comm_bytes"][dim], (dim, pred, got)
        assert pred["comm_calls"][dim] == got["comm_calls"][dim], (dim, pred, got)
