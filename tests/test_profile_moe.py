"""`shardwise profile` of MoE and long-context jobs: expert parallelism's all-to-all and context
parallelism's exchange charged to their own dimensions (`comm_exposed_s.ep`, `.cp`), their
findings priced by the planner, and MoE load imbalance as a finding.

One spawned world of 2 gloo ranks runs three profile cases (moe-tiny at ep 2, the same with a
skewed router start, the tiny decoder at cp 2), as `shardwise profile` captures them; the
analysis runs here. Nothing is asserted about how long a part took, only where time was
charged (a dimension without any call has none) and what triggers a finding: its measured
statistic, not its duration. The pricing is checked on given ledgers against the planner."""

import pytest

from shardwise.config import load_config
from shardwise.job import remedy_sharded
from shardwise.job.remedy import findings
from shardwise.launchers.harness import run_world
from shardwise.models.moe import moe_layers
from shardwise.plan.hardware import get_hardware
from shardwise.profile.ledger import DIMS, build, total
from support.profile_cases import BASE

WARMUP, MEASURED = 1, 2
PROFILE = [
    f"--profile.steps={MEASURED}",
    f"--profile.warmup={WARMUP}",
    f"--train.steps={WARMUP + MEASURED + 1}",
]
MOE = ["--model.name=moe-tiny", "--parallel.ep=2", "--data.seq_len=64"]
CASES = {
    "ep": (MOE, None),
    "skewed": (MOE, "test_profile_moe:skew_router"),
    "cp": (["--parallel.cp=2", "--data.seq_len=64"], None),
}


def skew_router(run) -> None:
    """A skewed start: expert 0's routing bias makes every token choose it (2x the mean load
    of 4 experts, top-2); no balancing moves it back."""
    for layer in moe_layers(run.model):
        layer.expert_bias[0] = 0.2


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """case -> the summary `shardwise profile` writes for it."""
    from shardwise.cli.profile import summarise

    root = tmp_path_factory.mktemp("profiles_moe")
    cases = []
    for name, (extra, hook) in CASES.items():
        overrides = [*BASE, *PROFILE, *extra, f"--run.dir={root / name}"]
        cases.append({"overrides": overrides, **({"hook": hook} if hook else {})})
    results = run_world(2, cases)
    out = {}
    for name, case, per_rank in zip(CASES, cases, results, strict=True):
        assert all("error" not in r for r in per_rank), per_rank[0].get("error")
        out[name] = summarise(load_config(None, case["overrides"]), 2)
    return out


def _steps(summary: dict) -> list[dict]:
    return [s for r in summary["ranks"] for s in r["steps"]]


@pytest.mark.slow  # (the 2-rank world)
@pytest.mark.parametrize("name,dim", [("ep", "ep"), ("skewed", "ep"), ("cp", "cp")])
def test_the_exchange_is_charged_to_its_own_dimension(profiled, name, dim):
    """Every rank of every measured step waited in its all-to-alls (ep) or exchanges (cp):
    that time sits under its dimension, the dp/tp/pp keys stay, the ledger still adds up."""
    for s in _steps(profiled[name]):
        assert s["comm_exposed_s"][dim] > 0, s
        assert set(s["comm_exposed_s"]) == set(DIMS) and {"dp", "tp", "pp"} <= set(DIMS)
        assert s["comm_exposed_s"]["tp"] == s["comm_exposed_s"]["pp"] == 0.0  # no such calls
        assert total(s) == pytest.approx(s["step_s"], abs=1e-5)
    other = "cp" if dim == "ep" else "ep"
    assert all(s["comm_exposed_s"][other] == 0.0 for s in _steps(profiled[name]))


@pytest.mark.slow  # (the 2-rank world)
def test_a_skewed_router_is_an_imbalance_finding_with_its_remedies(profiled):
    summary = profiled["skewed"]
    assert max(summary["moe"]["load_max_mean"]) == pytest.approx(2.0)  # every token on one
    found = [f for f in summary["findings"] if f["cause"] == "expert_load_imbalance"]
    assert len(found) == 1, summary["findings"]
    f = found[0]
    assert f["remedy"] == ["--train.moe_bias_balance=0.001"]
    assert f["alternatives"] == [["--train.moe_aux_loss=0.01"], ["--model.capacity_factor=1.25"]]
    assert f["load_max_mean"] == pytest.approx(2.0) and "2.00x" in f["evidence"]
    assert "dropped" in f["evidence"] and "not priced" in f["evidence"]
    assert f["predicted_gain"] == 0.0  # the planner prices balanced routing only


@pytest.mark.slow  # (the 2-rank world)
def test_a_balanced_router_has_no_imbalance_finding(profiled):
    summary = profiled["ep"]
    loads = summary["moe"]["load_max_mean"]
    assert len(loads) == 4 and max(loads) < remedy_sharded.IMBALANCE, loads
    assert all(f["cause"] != "expert_load_imbalance" for f in summary["findings"])


def test_edp_waits_are_data_parallel_and_ep_cp_have_their_own_keys():
    """The expert gradients' reduction (comm:edp) is dp's, as metrics' comm_bytes report it."""
    led = build(1.0, {"forward": 0.4, "comm:edp": 0.1, "comm:dp": 0.05, "comm:ep": 0.2,
                      "comm:cp": 0.15, "comm:world": 0.1}, {"edp": 0.3})  # fmt: skip
    assert led["comm_exposed_s"] == {"dp": 0.15, "tp": 0.0, "pp": 0.0, "cp": 0.15, "ep": 0.2}
    assert led["comm_overlapped_s"]["dp"] == 0.3 and led["other_s"] == 0.1
    assert total(led) == pytest.approx(1.0)


def _mean(step: float, **exposed: float) -> dict:
    led = build(step, {"forward": step - sum(exposed.values())}, {})
    led["comm_exposed_s"].update(exposed)
    return led


COMM = {k: {d: 1.0 for d in DIMS} for k in ("comm_bytes", "comm_calls")}


def test_exposed_ep_is_priced_by_the_planners_exchange():
    """ep 2 -> 1: the planner predicts no exchange at ep 1, so the measured ep wait goes."""
    cfg = load_config(None, [*BASE, *MOE])
    found = findings(cfg, 2, _mean(1.0, ep=0.3), [], COMM, get_hardware("cpu"))
    f = next(f for f in found if f["cause"] == "exposed_ep_communication")
    assert f["remedy"] == ["--parallel.ep=1"]
    assert f["predicted_step_s"] == pytest.approx(0.7)


CP = [*BASE, "--parallel.cp=2", "--data.seq_len=64"]


def test_exposed_cp_names_the_other_mode_only_where_the_planner_prices_it_lower():
    """At this shape on the cpu hardware the planner exposes less exchange with ring than
    with ulysses: a ring run gets no mode remedy, an ulysses run gets ring, priced by the
    planner's ratio of the two modes' exposed exchange."""
    hw = get_hardware("cpu")
    ring, ulysses = (
        load_config(None, [*CP, f"--parallel.cp_mode={m}"]) for m in ("ring", "ulysses")
    )
    ratio = (
        remedy_sharded.planned(ring, 2, hw)["time"]["cp_exposed_s"]
        / remedy_sharded.planned(ulysses, 2, hw)["time"]["cp_exposed_s"]
    )
    assert ratio < 1
    for cfg, remedy, step in (
        (ring, [], 1.0),
        (ulysses, ["--parallel.cp_mode=ring"], 0.8 + 0.2 * ratio),
    ):
        found = findings(cfg, 2, _mean(1.0, cp=0.2), [], COMM, hw)
        f = next(f for f in found if f["cause"] == "exposed_cp_communication")
        assert f["remedy"] == remedy and f["predicted_step_s"] == pytest.approx(step)


@pytest.mark.slow  # (the 2-rank world)
def test_moe_statistics_are_one_host_read_a_step(profiled):
    """An MoE model's routing statistics (every layer's loads, drops and balance loss) reach
    the host in one read a step, counted among the engine's own sites: the per-layer reads
    they replaced were a host sync each."""
    for r in profiled["ep"]["ranks"]:
        syncs = r["host_syncs"]
        assert syncs["by_site"]["training/moe.py:after_step"] == 1, syncs["by_site"]
        assert "training/moe.py:after_step" in syncs["engine_sites"]
        assert "training/moe.py:after_step" not in syncs["unexpected"]
