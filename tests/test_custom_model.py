"""Your own nn.Module: a model defined outside the package (tests/user/
models.py: an MLP on the digits images and a small causal transformer from torch's layers on
text) trains through `model.name=FILE:FACTORY`; dp2 ZeRO-3 (and full recomputation) reproduce
the single process, a ZeRO-3 dp2 checkpoint resumes on one process, the planner predicts its
model states exactly and its peak within 5 %, and bad factories stop before launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_here, run_named_worlds
from shardwise.plan.hardware import get_hardware
from shardwise.training.validate import derive
from support.compare import VOCAB, max_param_diff, max_rel

USER = Path(__file__).resolve().parent / "user" / "models.py"
COMMON = [
    "--train.steps=8",
    "--train.eval_every=0",
    "--train.eval_batches=0",
    "--optim.warmup_steps=2",
    "--train.lr=1e-3",
    "--optim.eps=1e-6",  # (testing/compare.py: below fp32 rounding noise, 1e-8 amplifies it)
]
MLP = [f"--model.name={USER}:mlp", "--data.dataset=digits", "--train.global_batch=16", *COMMON]
LM = [
    f"--model.name={USER}:transformer",
    f"--model.vocab_size={VOCAB}",  # the parity tests' cached BPE
    "--data.seq_len=32",
    "--train.global_batch=8",
    *COMMON,
]
HALF = "step-00000004"


def _case(*overrides: str) -> dict:
    return {"overrides": list(overrides)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("custom")
    ckpt = ["--checkpoint.every=4", f"--checkpoint.dir={root / 'lm_z3'}"]
    worlds = {
        1: {"mlp": _case(*MLP), "lm": _case(*LM)},
        2: {
            "mlp_z3": _case(*MLP, "--parallel.zero=3"),
            "lm_z3": _case(*LM, "--parallel.zero=3", *ckpt),
            "lm_z2_full": _case(*LM, "--parallel.zero=2", "--memory.recompute=full"),
            "lm_dp": _case(*LM),
        },
    }
    out = {
        name: per_rank
        for world in run_named_worlds(worlds).values()
        for name, per_rank in world.items()
    }
    resume = [f"--checkpoint.resume={root / 'lm_z3' / HALF}", f"--checkpoint.dir={root / 'r'}"]
    out["lm_z3_to_1"] = [run_here(_case(*LM, *resume), str(tmp_path_factory.mktemp("one")))]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "ref"),
    [("mlp_z3", "mlp"), ("lm_z3", "lm"), ("lm_z2_full", "lm"), ("lm_dp", "lm")],
)
def test_layouts_reproduce_the_single_process(runs, name, ref):
    got, want = runs[name][0], runs[ref][0]
    first, last = want["losses"][0], want["losses"][-1]
    assert last < first, "it trained"
    assert max_rel(got["losses"], want["losses"]) <= 1e-5, (got["losses"], want["losses"])
    assert max_param_diff(got["params"], want["params"]) <= 1e-5
    assert all(torch.isfinite(p).all() for p in got["params"].values())


@pytest.mark.slow
def test_a_zero3_dp2_checkpoint_resumes_on_one_process(runs):
    resumed, full = runs["lm_z3_to_1"][0], runs["lm"][0]
    assert [r["step"] for r in resumed["records"]] == [5, 6, 7, 8]
    assert max_rel(resumed["losses"], full["losses"][4:]) <= 1e-5
    assert max_param_diff(resumed["params"], full["params"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(("name", "overrides"), [("mlp_z3", MLP), ("lm_z3", LM)])
def test_the_planner_predicts_your_modules_memory(runs, name, overrides):
    cfg = load_config(None, [*overrides, "--parallel.zero=3"])
    record = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))
    pred, last = record["mem_bytes"], runs[name][0]["records"][-1]
    measured = last["mem_bytes"]
    for key in ("params", "grads", "master", "optimizer"):
        assert pred[key] == measured[key], (key, pred, measured)
    assert abs(pred["total"] - measured["total"]) <= 0.05 * measured["total"], (pred, measured)
    # and ZeRO-3's traffic from the module's own units, byte for byte and call for call
    assert record["comm_bytes"]["dp"] == last["comm_bytes"]["dp"] > 0
    assert record["comm_calls"]["dp"] == last["comm_calls"]["dp"]


def test_a_forward_that_reads_a_value_is_priced_without_activations_and_says_where():
    """A module whose forward calls `.item()` cannot run on the fake tensors the planner
    measures activations with: explain (and so every job's pre-launch check) prices its states
    exactly as for the plain MLP, counts activations as 0, and names the line that read the
    value, instead of a traceback from inside torch."""
    hw = get_hardware("cpu", calibrate=False)
    watched = [f"--model.name={USER}:watched_mlp", *MLP[1:]]
    record = explain_record(load_config(None, watched), 1, hw)
    plain = explain_record(load_config(None, MLP), 1, hw)
    assert f"{USER}:" in record["activations_unmeasured"]
    assert ".item()" in record["activations_unmeasured"]  # the source line itself
    assert record["mem_bytes"]["activations"] == 0 < plain["mem_bytes"]["activations"]
    for key in ("params", "grads", "master", "optimizer"):
        assert record["mem_bytes"][key] == plain["mem_bytes"][key]
    assert any("activations are not predicted" in w for w in record["warnings"])
    assert "activations_unmeasured" not in plain


def test_init_is_the_modules_own_reset_under_a_seeded_generator():
    """Same (seed, name) -> same values whatever else is built; torch's own init rule (a
    Linear's kaiming-uniform bound 1/sqrt(fan_in)) is what the values follow."""
    from shardwise.models import build_model, init_weights, to_empty

    def built(seed: int) -> dict[str, torch.Tensor]:
        spec = derive(load_config(None, MLP), 1).spec
        with torch.device("meta"):
            model = build_model(spec)
        to_empty(model, torch.device("cpu"))
        init_weights(model, seed)
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    a, b, c = built(0), built(0), built(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["1.weight"], c["1.weight"])
    bound = 1 / (32 * 32) ** 0.5
    assert a["1.weight"].abs().max() <= bound and a["1.weight"].abs().max() > 0.9 * bound


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tests/user/nowhere.py:mlp", r"is not a file"),
        ("no_such_package_xyz:build", r"importing 'no_such_package_xyz' failed"),
        (f"{USER}:missing", r"has no 'missing'"),
        (f"{USER}:not_a_module", r"returned dict, not a torch.nn.Module"),
        (f"{USER}:Scaled", r"holds parameters \['scale'\] but has no reset_parameters"),
    ],
)
def test_a_bad_factory_is_one_clear_error_before_launch(name, message):
    with pytest.raises(ConfigError, match=message):
        derive(load_config(None, [f"--model.name={name}", "--data.dataset=digits"]), 1)


def test_options_that_do_not_apply_to_your_module_are_refused():
    with pytest.raises(ConfigError, match=r"model.n_layers does not apply"):
        derive(load_config(None, [*MLP, "--model.n_layers=2"]), 1)
    with pytest.raises(ConfigError, match=r"tensor parallelism needs a plan"):
        derive(load_config(None, [*LM, "--parallel.tp=2"]), 2)
    with pytest.raises(ConfigError, match=r"pipeline parallelism .* your own module"):
        derive(load_config(None, [*LM, "--parallel.pp=2"]), 2)
