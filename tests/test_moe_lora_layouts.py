"""LoRA on routed experts (models/expert_lora.py) in the layouts tests/test_moe_lora.py leaves
out, and the planner's formula for its model states.

One 4-rank world runs every multi-rank case, one process the references (moe-tiny at 2 blocks,
targets `experts,wq,wv`; the tiny OLMoE checkpoint of tests/test_hf_moe.py, targets
`experts,q_proj,v_proj`; rank 4, 4 AdamW steps): ZeRO-1 and ZeRO-2 at ep 2 x dp 2, OLMoE at
ep 2, a capacity factor that drops tokens at ep 2, all in fp32, reproduce one process within
1e-5; bf16 compute at ep 2 reproduces the single bf16 process within its rounding. The
formula path of the planner (no model built: what `shardwise plan` prices for a preset)
predicts params, grads, master and optimizer bytes per rank exactly at ep 1 and ep 2 under
ZeRO-0 to ZeRO-3."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from shardwise.config import load_config
from shardwise.job.describe import job_from_config, layout_from_config
from shardwise.job.fake import meta_model, model_units
from shardwise.launchers.harness import run_named_worlds
from shardwise.plan.hardware import get_hardware
from shardwise.plan.search import evaluate
from shardwise.training.validate import derive
from support.compare import assert_reproduces, case, worst_tensor
from test_hf_moe import STEPS, _lm, world  # noqa: F401 (the checkpoints' fixture)

MOE = ["--model.name=moe-tiny", "--train.steps=4", "--optim.warmup_steps=1"]
PAIR = ["--finetune.lora_rank=4", "--finetune.lora_alpha=8"]
LORA = [*PAIR, "--finetune.lora_targets=experts,wq,wv"]
HF_LORA = [*PAIR, "--finetune.lora_targets=experts,q_proj,v_proj"]
EP2 = ["--parallel.ep=2"]  # on 4 ranks: ep 2 x dp 2
BF16 = ["--precision.compute=bf16"]  # fp32 masters and gradient reduction
CAPACITY = ["--model.capacity_factor=1.0"]  # slots per (sequence, expert): top_k·s/E
STATES = ("params", "grads", "master", "optimizer")

# name: (the reference's name, overrides on 4 ranks); the reference runs on one process
FOUR = {
    "moe_ep1": ("moe", [*LORA]),  # dp 4
    "moe_ep1_z3": ("moe", [*LORA, "--parallel.zero=3"]),
    "moe_ep2_z1": ("moe", [*LORA, *EP2, "--parallel.zero=1"]),
    "moe_ep2_z2": ("moe", [*LORA, *EP2, "--parallel.zero=2"]),
    "moe_ep2_z3": ("moe", [*LORA, *EP2, "--parallel.zero=3"]),
    "moe_bf16_ep2": ("moe_bf16", [*LORA, *BF16, *EP2]),
    "moe_capacity_ep2": ("moe_capacity", [*LORA, *CAPACITY, *EP2]),
}
FP32 = [n for n, (ref, _) in FOUR.items() if ref != "moe_bf16"]


def _moe(*extra: str) -> list[str]:
    return case(*MOE, *extra)["overrides"]


def _olmoe(world, *extra: str) -> list[str]:  # noqa: F811
    return _lm(world, "olmoe", *STEPS, *HF_LORA, *extra)


@pytest.fixture(scope="module")
def runs(world):  # noqa: F811
    one = {
        "moe": {"overrides": _moe(*LORA)},
        "moe_bf16": {"overrides": _moe(*LORA, *BF16)},
        "moe_capacity": {"overrides": _moe(*LORA, *CAPACITY)},
        "olmoe": {"overrides": _olmoe(world)},
    }
    four = {name: {"overrides": _moe(*extra)} for name, (_, extra) in FOUR.items()}
    four["olmoe_ep2"] = {"overrides": _olmoe(world, *EP2)}
    out = {n: r for w in run_named_worlds({1: one, 4: four}).values() for n, r in w.items()}
    for name, ranks in out.items():
        for r in ranks:
            assert "error" not in r, (name, r["error"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [*FP32, "olmoe_ep2"])
def test_fp32_layouts_reproduce_one_process(runs, name):
    """ep 1 x dp 4 (ZeRO-0, ZeRO-3) and ep 2 x dp 2 (ZeRO-1, ZeRO-2, ZeRO-3, a capacity
    factor; OLMoE at ZeRO-0): losses and gradient norms within 1e-5 relative every step, every
    parameter (experts and their pairs gathered over ep) within 1e-5, on every rank."""
    ref = "olmoe" if name == "olmoe_ep2" else FOUR[name][0]
    assert_reproduces(name, runs[name], runs[ref][0])


@pytest.mark.slow
def test_a_capacity_drops_the_same_tokens_at_ep2(runs):
    """With model.capacity_factor=1 some routed assignments are dropped, and every ep 2 rank
    reports the single process's count per layer and step (the capacity is per sequence,
    decided where the sequence is)."""
    want = [r["moe_dropped"] for r in runs["moe_capacity"][0]["records"]]
    assert sum(map(sum, want)) > 0, want
    for rank in runs["moe_capacity_ep2"]:
        assert [r["moe_dropped"] for r in rank["records"]] == want


@pytest.mark.slow
def test_bf16_at_ep2_reproduces_one_bf16_process(runs):
    """bf16 compute, fp32 masters and reduction: ep 2 x dp 2 against one bf16 process. The
    same products are rounded to bf16 over other groups (a rank's 2 samples, not 8; an
    expert's rows gathered from 2 ranks' micro-batches), so, as in tests/test_hf_models.py,
    the losses and gradient norms agree within one bf16 rounding (2^-8 relative). The frozen
    base is bitwise the single process's. The pairs: Adam moves a coordinate by at most ~lr
    a step whatever its gradient (|m̂|/√v̂ <= 1.002 over the first 4 steps at the default
    betas 0.9, 0.95, by Cauchy-Schwarz on the bias-corrected moments), so one whose gradient
    is zero up to that rounding (rows cancelling, summed in other groups: the argument of
    support/compare.py) may go either way in each run: within 2·1.002·Σ lr, plus one bf16
    step of a copy at |w| < 2^-3 (2^-11). An expert's pair mixed up with another's (A drawn
    at up to 1/√in, 0.088 for w1) would be far outside."""
    one, fp32 = runs["moe_bf16"][0], runs["moe"][0]
    assert one["losses"] != fp32["losses"]  # it computed in bf16
    assert_reproduces("moe_bf16_ep2", runs["moe_bf16_ep2"], one, tol=2**-8, params=False)
    pairs = [n for n in one["params"] if ".lora_" in n]
    assert max(one["params"][n].abs().max().item() for n in pairs) < 2**-3
    bound = 2 * 1.002 * sum(r["lr"] for r in one["records"]) + 2**-11
    for i, rank in enumerate(runs["moe_bf16_ep2"]):
        assert rank["params"].keys() == one["params"].keys()
        for n, want in one["params"].items():
            if n not in pairs:
                assert torch.equal(rank["params"][n], want), (i, n)
        worst, where = worst_tensor({n: rank["params"][n] for n in pairs}, one["params"])
        assert worst <= bound, (i, where, worst, bound)


def _formula(overrides: list[str], ranks: int) -> dict:
    """The planner's prediction from the spec's formula units (no model built, as `plan`
    prices a preset), for exactly this config."""
    cfg = load_config(None, overrides)
    d = derive(cfg, ranks)
    job = job_from_config(cfg, get_hardware("cpu", calibrate=False), ranks, d.spec)
    assert job.frozen is None  # not the real model's units
    return evaluate(job, layout_from_config(cfg, d))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR))
def test_the_formula_states_the_model_memory_per_rank_exactly(runs, name):
    """The formula's params, grads, master and optimizer bytes per rank equal the engine's
    (max over ranks) at ep 1 x dp 4 (ZeRO-0, ZeRO-3) and ep 2 x dp 2 (ZeRO-0 with a capacity,
    ZeRO-1, ZeRO-2, ZeRO-3): the expert pairs [E, r, in] and [E, out, r] beside the attention
    pairs, at 1/ep with their experts, reduced and ZeRO-sharded over the ranks holding the
    same experts; in fp32 (no master) and bf16 (16-bit pairs, fp32 masters). Without the
    expert pairs the formula would be short of them."""
    overrides = _moe(*FOUR[name][1])
    pred = _formula(overrides, 4)["mem_bytes"]
    for key in STATES:
        got = max(r["records"][-1]["mem_bytes"][key] for r in runs[name])
        assert pred[key] == got, (key, pred[key], got)
    attention = [x for x in FOUR[name][1] if x != LORA[-1]] + ["--finetune.lora_targets=wq,wv"]
    assert _formula(_moe(*attention), 4)["mem_bytes"]["grads"] < pred["grads"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--finetune.lora_targets=experts,wq,wv"],
        ["--finetune.lora_targets=experts,w1,w2", "--model.n_shared_experts=1"],
        ["--finetune.lora_targets=w3,wo", "--model.moe_every=2", "--parallel.zero=3"],
        ["--finetune.lora_targets=all-linear", "--model.n_shared_experts=1", "--model.moe_every=2"],
        ["--finetune.lora_targets=experts,wk", *BF16, *EP2, "--parallel.zero=1"],
        ["--finetune.lora_targets=w2,wq", *BF16, "--parallel.ep=4", "--parallel.zero=3"],
        [
            "--finetune.lora_targets=experts",
            "--model.n_shared_experts=2",
            *EP2,
            "--parallel.zero=2",
        ],
    ],
)
def test_the_formula_units_price_as_the_real_models(extra):
    """The formula's model states equal those of the real model's units (built on meta, as
    `explain` counts them) on 4 ranks: shared experts (their linears adapted beside the
    experts' pairs), dense blocks between MoE ones, `all-linear` (the routers adapted too),
    bf16, ep 1, 2 and 4, ZeRO-0 to ZeRO-3."""
    overrides = _moe("--model.n_layers=4", *PAIR, *extra)
    pred = _formula(overrides, 4)["mem_bytes"]
    cfg = load_config(None, overrides)
    d = derive(cfg, 4)
    job = job_from_config(cfg, get_hardware("cpu", calibrate=False), 4, d.spec)
    real_units = tuple(model_units(meta_model(cfg, d.spec)))
    real = evaluate(dataclasses.replace(job, frozen=real_units), layout_from_config(cfg, d))
    trained = sum(e[0] for u in real_units for e in u.entries if e[1])
    assert trained > 0
    for key in STATES:
        assert pred[key] == real["mem_bytes"][key], (key, pred[key], real["mem_bytes"][key])
