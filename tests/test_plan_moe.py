"""The planner's MoE blocks (plan/moe.py): model states against the real model's units, step
time against the dense block it generalises, expert parallelism's exchange against the bytes
traffic.ep_traffic counts, MFU against training's own FLOP count, and the search over ep
(proposed where the experts do not fit otherwise, pinned by --parallel.ep, applied by --plan
auto). Pure planner: meta and fake models, no ranks."""

import dataclasses

import pytest
import torch

from shardwise.cli.plan import pinned_layout
from shardwise.config import load_config
from shardwise.job.auto import apply_layout
from shardwise.job.experts import expert_units
from shardwise.job.predict import model_units
from shardwise.models import ModelSpec, build_model, count_params
from shardwise.models.moe import inactive_params
from shardwise.plan import gpu, moe, report, search, traffic
from shardwise.plan import memory as mem
from shardwise.plan import time as tm
from shardwise.plan.hardware import CATALOG
from shardwise.plan.layout import Job, Layout
from shardwise.plan.shapes import units
from shardwise.plan.states import add_states, model_states
from shardwise.training.validate import derive

H100 = CATALOG["h100-sxm"]
# 4 blocks, every second one MoE: 8 experts top-2 and a shared expert
SPEC = ModelSpec(
    "moe", 4, 256, 4, 2, 512, 1000, 512, n_experts=8, top_k=2, n_shared_experts=1, moe_every=2
)


def _meta(spec: ModelSpec) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(spec)


def _job(spec: ModelSpec = SPEC, devices: int = 8, hw=H100, **kw) -> Job:
    return Job(spec, hw, devices, seq_len=512, global_batch=64, **kw)


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_formula_units_equal_the_real_models_units(ep):
    """shapes.units of an MoE spec (split by moe.split_units under ep) hold exactly the real
    model's parameters per unit kind: the dense units' and the expert units' element counts
    equal job/experts.expert_units' of the meta model, and the whole equals count_params."""
    model = _meta(SPEC)
    real_dense, real_experts = expert_units(model, ep) if ep > 1 else (model_units(model), [])
    dense, experts = moe.split_units(list(units(SPEC)), SPEC, ep)
    total = sum(u.numel * u.count for u in units(SPEC))
    assert total == count_params(model)
    assert sum(u.numel * u.count for u in dense) == sum(u.numel for u in real_dense)
    assert sum(u.numel * u.count for u in experts) == sum(u.numel for u in real_experts)
    assert sorted(e[0] for u in experts for e in u.entries for _ in range(u.count)) == sorted(
        e[0] for u in real_experts for e in u.entries
    )


def test_moe_mlp_costs_top_k_dense_mlps_plus_the_router():
    """With no fixed cost per kernel and GEMMs that are compute-bound, an MoE block's forward
    GEMMs cost the dense block's (attention + an MLP of the same ffn_dim) plus top_k - 1 more
    MLPs of the routed rows, the router and the shared expert: the grouped GEMM is the routed
    tokens' GEMMs, however they split over the experts."""
    hw = dataclasses.replace(H100, kernel_s=0.0)
    peak, tokens = hw.peak["bf16"], 8 * 4096
    dense = moe.dense_spec(SPEC)
    spec = dataclasses.replace(SPEC, dim=4096, ffn_dim=8192, n_heads=32, n_kv_heads=8)
    dense = dataclasses.replace(dense, dim=4096, ffn_dim=8192, n_heads=32, n_kv_heads=8)

    def fwd(s, ep=1) -> float:
        return sum(gpu._gemm(hw, 2, *g, peak) for g in gpu._gemms(s, 1, tokens, ep))

    def flops(m, n, k) -> float:
        return 2.0 * m * n * k / (peak * hw.matmul_eff)

    mlp = 3 * flops(tokens, spec.ffn_dim, spec.dim)
    router = gpu._gemm(hw, 2, tokens, spec.n_experts, spec.dim, peak)
    expected = fwd(dense) + (spec.top_k - 1 + spec.n_shared_experts) * mlp + router
    assert fwd(spec) == pytest.approx(expected, rel=1e-9)
    # every expert's group a kernel: with the fixed cost back, E/ep groups of 3 GEMMs
    for ep in (1, 4):
        extra = fwd(spec, ep) - sum(
            gpu._gemm(H100, 2, *g, peak) for g in gpu._gemms(spec, 1, tokens, ep)
        )
        assert extra == pytest.approx(-H100.kernel_s * len(gpu._gemms(spec, 1, tokens, ep)))
    assert len(gpu._gemms(spec, 1, tokens, 4)) == len(gpu._gemms(spec, 1, tokens, 1)) - 3 * 6


def test_ep_adds_the_exposed_all_to_all_at_the_group_link():
    """Under ep the step carries ep_traffic's bytes over the ep group's NVLink and its calls'
    latency, all of it exposed and in step_s; more than the same layout at ep = 1 pays for the
    exchange (its GEMMs the same rows)."""
    job = _job()
    lay = Layout(dp=8, ep=4, zero=1, micro_batch=2)
    rec = search.evaluate(job, lay)
    moved, calls = traffic.ep_traffic(job, lay)
    expected = moved / (H100.intra_bw * H100.comm_eff) + calls * H100.latency
    assert rec["time"]["ep_comm_s"] == pytest.approx(expected)
    assert rec["time"]["ep_exposed_s"] == rec["time"]["ep_comm_s"] > 0
    parts = rec["time"]
    summed = sum(v for k, v in parts.items() if k not in ("step_s", "dp_comm_s", "ep_comm_s"))
    assert parts["step_s"] == pytest.approx(summed)
    assert rec["comm_bytes"]["ep"] == moved and rec["comm_calls"]["ep"] == calls
    # across nodes (ep x tp beyond a node's 8): the NIC's bandwidth
    wide = search.evaluate(_job(devices=32), Layout(dp=32, ep=4, zero=1, micro_batch=2))
    small = dataclasses.replace(H100, per_node=2)
    narrow = search.evaluate(_job(hw=small), lay)
    assert narrow["time"]["ep_comm_s"] > wide["time"]["ep_comm_s"] * 2


def test_a_pipeline_stage_exchanges_the_tokens_of_its_own_moe_layers():
    """Under pp a rank routes its micro-batches through its stage's MoE blocks only: plan's ep
    bytes and calls are ep_traffic's for the busiest stage's (what `explain` counts per
    stage), not the whole model's. With pp 2 and half the dp, a rank sends as many bytes as
    without pp: half the layers, twice the micro-batches."""
    job = _job()
    flat = search.evaluate(job, Layout(dp=8, ep=4, zero=1, micro_batch=2))
    lay = Layout(pp=2, dp=4, ep=4, zero=1, micro_batch=2)
    staged = search.evaluate(job, lay)
    stage = moe.moe_blocks(SPEC, SPEC.n_layers // 2)
    moved, calls = traffic.ep_traffic(job, lay, layers=stage)
    assert (staged["comm_bytes"]["ep"], staged["comm_calls"]["ep"]) == (moved, calls)
    assert staged["comm_bytes"]["ep"] == flat["comm_bytes"]["ep"] > 0
    assert traffic.ep_traffic(job, lay)[0] == 2 * moved  # the whole model's: twice
    link = H100.intra_bw * H100.comm_eff
    assert staged["time"]["ep_comm_s"] == pytest.approx(moved / link + calls * H100.latency)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_ep_shards_the_expert_states_as_the_real_models_units(zero):
    """The planner's model states under ep equal the dense units' over dp plus the expert
    units' (E/ep experts, from the meta model) over the dp/ep ranks holding them: the
    accounting job/predict.py does for `explain`, here from the formula's units."""
    job, ep = _job(precision="bf16", reduce="bf16"), 4
    lay = Layout(dp=8, ep=ep, zero=zero, micro_batch=2)
    got = search.evaluate(job, lay)["mem_bytes"]
    dense, experts = expert_units(_meta(SPEC), ep)
    want = model_states(dense, job, 8, zero, "none")
    edp_job, edp = mem.expert_group(job, lay, ep)
    add_states(want, model_states(experts, edp_job, edp.dp, edp.zero, "none"))
    for key in ("params", "grads", "master", "optimizer"):
        assert got[key] == round(want[key]), key
    at_one = search.evaluate(job, dataclasses.replace(lay, ep=1))["mem_bytes"]
    if zero < 3:  # 16-bit parameters whole on every rank: ep keeps 1/ep of the experts
        experts_all = moe.moe_blocks(SPEC) * SPEC.n_experts * 3 * SPEC.dim * SPEC.ffn_dim
        assert at_one["params"] - got["params"] == 2 * experts_all * (1 - 1 / ep)


def test_mfu_counts_active_parameters_as_training_does():
    """The planner's model FLOPs per token are training/metrics.flops_per_token's: 6 x the
    non-embedding parameters less the routed experts a token skips, + 12·L·h·s."""
    model = _meta(SPEC)
    job = _job()
    active = count_params(model, exclude_embedding=True) - inactive_params(model)
    want = 6.0 * active + 12.0 * SPEC.n_layers * SPEC.dim * job.seq_len
    assert tm.model_flops_per_token(job) == pytest.approx(want)
    assert moe.active_params(job) == active
    assert "active parameters" in tm.FLOP_CONVENTION


def _big_experts(devices: int = 8) -> Job:
    """64 experts of 4096 x 8192 in 4 blocks (25.8B expert parameters) on 80 GiB cards."""
    spec = ModelSpec("moe", 4, 4096, 32, 8, 8192, 32000, 4096, n_experts=64, top_k=2)
    return dataclasses.replace(_job(spec, devices, precision="bf16"), pinned=(("zero", 1),))


def test_the_search_proposes_ep_where_the_experts_fit_no_other_way():
    """With ZeRO-1 pinned every rank holds 16-bit parameters and gradients of every expert it
    holds (4 bytes x 25.8B > 80 GiB): only layouts that split the experts fit (over ep ranks,
    or by layer over pipeline stages; tp keeps them whole), and the search proposes them; at
    ep = pp = 1 (pinned) nothing fits."""
    job = _big_experts()
    result = search.search(job)
    assert result.candidates and all(r["ep"] > 1 or r["pp"] > 1 for r in result.candidates)
    assert {r["ep"] for r in result.candidates} <= {1, 2, 4, 8}
    assert any(r["ep"] > 1 and r["pp"] == 1 for r in result.candidates)
    assert "--parallel.ep=" + str(result.candidates[0]["ep"]) in report.train_flags(
        result.candidates[0]
    )
    pinned = dataclasses.replace(job, pinned=(("zero", 1), ("ep", 1), ("pp", 1)))
    assert not search.search(pinned).candidates
    assert search.invalid(job, Layout(dp=8, ep=3, zero=1)) is not None  # 64 % 3
    dense = dataclasses.replace(job, spec=moe.dense_spec(job.spec))
    assert search.invalid(dense, Layout(dp=8, ep=2, zero=1)) == "ep without routed experts"
    assert search.invalid(job, Layout(tp=2, dp=4, zero=1)).startswith("MoE tp without sp")
    assert search.invalid(job, Layout(tp=2, dp=4, zero=1, sp=True)) is None


def test_parallel_ep_pins_the_search_and_plan_auto_applies_it():
    """--parallel.ep is a plan pin (cli/plan.PINS); a candidate's ep reaches the config
    --plan auto runs, which derive accepts."""
    cfg = load_config(None, ["--model.name=moe-tiny", "--parallel.ep=2"])
    assert ("ep", 2) in pinned_layout(cfg, ["--parallel.ep=2"])
    job = dataclasses.replace(_big_experts(), pinned=(("zero", 1), ("ep", 4)))
    cands = search.search(job).candidates
    assert cands and {r["ep"] for r in cands} == {4}
    cand = {**search.evaluate(_job(moe.dense_spec(SPEC)), Layout(dp=4)), "ep": 2}
    chosen = apply_layout(load_config(None, ["--model.name=moe-tiny"]), cand)
    assert chosen.parallel.ep == 2
    assert derive(chosen, 4).ep == 2


def test_explain_predicts_the_step_time_plan_prices():
    """`explain` of an MoE decoder under ep states a step time (it had none), the one `plan`
    prices for the same layout from the formula's units (equal to the real model's), with the
    exposed all-to-all in it and MFU of the active parameters."""
    from shardwise.job.explain import explain_record
    from shardwise.job.predict import job_from_config, layout_from_config

    args = ["--model.name=moe-tiny", "--data.seq_len=256", "--precision.compute=bf16"]
    cfg = load_config(None, [*args, "--parallel.ep=2", "--train.global_batch=8"])
    rec = explain_record(cfg, 4, H100)
    assert rec["time"]["ep_exposed_s"] > 0 and "active parameters" in rec["flop_convention"]
    d = derive(cfg, 4)
    planned = search.evaluate(job_from_config(cfg, H100, 4, d.spec), layout_from_config(cfg, d))
    assert rec["step_time_s"] == pytest.approx(planned["step_time_s"], rel=1e-9)
    assert rec["mfu"] == pytest.approx(planned["mfu"], rel=1e-9)


def test_plan_cli_searches_ep_and_states_what_explain_states(capsys):
    """`shardwise plan --json` on an MoE preset: ep among the searched degrees, no tp or pp
    (the MoE decoder runs neither), each candidate's train_flags carrying its ep, and its model
    states and step time those `explain` gives for the same layout."""
    import json

    from shardwise.cli.main import main
    from shardwise.job.explain import explain_record

    args = ["--data.seq_len=256", "--precision.compute=bf16", "--train.global_batch=8"]
    argv = ["plan", "--model", "moe-tiny", "--hardware", "h100", "--devices", "4", "--json"]
    assert main([*argv, "--top", "500", *args]) == 0
    cands = json.loads(capsys.readouterr().out)["candidates"]
    assert {c["ep"] for c in cands} == {1, 2, 4}
    assert all(c["tp"] == c["pp"] == 1 for c in cands)
    assert all(f"--parallel.ep={c['ep']}" in c["train_flags"] for c in cands)
    cand = next(c for c in cands if c["ep"] == 2 and c["zero"] == 1 and c["recompute"] == "none")
    flags = [f for f in cand["train_flags"] if "grad_compression" not in f]
    cfg = load_config(None, ["--model.name=moe-tiny", *args, *flags])
    rec = explain_record(cfg, 4, H100)
    for key in ("params", "grads", "optimizer"):
        assert cand["mem_bytes"][key] == rec["mem_bytes"][key], key
    assert cand["step_time_s"] == pytest.approx(rec["step_time_s"], rel=1e-9)


def _lora_moe_flops(spec: ModelSpec, adapted: list[str], rank: int, tokens: int) -> int:
    """FLOPs (torch's count) of one MoE layer's forward and backward, base frozen, the input
    needing its gradient as after attention; `adapted` stacked weights with rank-r pairs."""
    from torch.utils.flop_counter import FlopCounterMode

    from shardwise.models import moe as moe_model
    from shardwise.models.expert_lora import add_expert_adapters

    torch.manual_seed(0)
    layer = moe_model.MoE(spec)
    if adapted:
        add_expert_adapters(layer, adapted, rank, 2.0 * rank, in_out=True)
    for name, p in layer.named_parameters():
        torch.nn.init.normal_(p, std=0.02)
        p.requires_grad_("lora_" in name)  # the base frozen, as finetune/lora.py freezes it
    x = torch.randn(1, tokens, spec.dim, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        layer(x).sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("targets", ["experts,wq", "w2", "wq"])
def test_expert_adapters_flops_are_the_real_layers(monkeypatch, targets):
    """plan/moe.lora_gemms (forward; backward twice that) against torch's FLOP count of our
    MoE layer with and without expert adapters. The per-expert loop stands in for
    torch._grouped_mm, which the counter does not count: each group times its expert's matrix,
    the same products. Dropless top-2 of 4 experts: rows total tokens·k, however routed."""
    from shardwise.job.describe import finetune_of
    from shardwise.models import moe as moe_model

    monkeypatch.setattr(moe_model, "grouped_mm_runs", lambda *a, **k: False)
    spec, rank, tokens = ModelSpec("moe", 1, 128, 4, 2, 176, 512, 512, n_experts=4), 8, 32
    over = [f"--finetune.lora_rank={rank}", f"--finetune.lora_targets={targets}"]
    ft = finetune_of(load_config(None, over), spec)
    adapted = {"experts,wq": ["w1", "w3", "w2"], "w2": ["w2"], "wq": []}[targets]
    assert list(ft.lora_experts) == adapted
    extra = _lora_moe_flops(spec, adapted, rank, tokens) - _lora_moe_flops(spec, [], rank, tokens)
    gemms = moe.lora_gemms(spec, ft, 1, tokens, 1, 4)  # fp32: rank 8 needs no padding
    assert extra == 3 * sum(2 * m * n * k for m, n, k in gemms)
    assert (extra > 0) == bool(adapted)
    job = dataclasses.replace(_job(spec), finetune=ft)
    plain = dataclasses.replace(job, finetune=dataclasses.replace(ft, lora_experts=()))
    layout = Layout(dp=8, micro_batch=1)
    more = gpu.layer_seconds(H100, job, layout) - gpu.layer_seconds(H100, plain, layout)
    assert (more > 0) == bool(adapted)  # step time prices them
