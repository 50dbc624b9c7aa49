"""Data parallelism reproduces the single-process run, and matches PyTorch DDP.

One spawned world per size runs every case (process start-up dominates on 2 cores)."""

import math

import pytest
import torch

from shardwise.launchers.harness import run_cases
from shardwise.training.metrics import format_line
from support.compare import case, max_param_diff, max_rel

pytestmark = pytest.mark.slow


DDP = "support.peers:ddp_peer"
WORLD1 = {
    "ref": case(),
    "ref_accum": case("--train.micro_batch=2"),
    "recompute_full": case("--memory.recompute=full"),
    "recompute_selective": case("--memory.recompute=selective"),
}
WORLD2 = {
    "dp": case(),
    "dp_accum": case("--train.micro_batch=2"),
    "ddp": case(peer=DDP),
    "ddp_accum": case("--train.micro_batch=2", peer=DDP),
    "bf16_reduce": case("--precision.reduce=bf16", "--train.steps=2"),
    "small_buckets": case("--parallel.bucket_mb=0.05", "--train.steps=3"),
    "fp16_inf": case(
        "--precision.compute=fp16",
        "--train.steps=5",
        hook="support.hooks:inject_inf_on_rank1_step3",
    ),
}
HOOKS = "support.hooks:"
WORLD2["nan_loss"] = case("--train.steps=5", hook=HOOKS + "nan_loss_on_rank1_step3")
WORLD2["inf_grad"] = case("--train.steps=5", hook=HOOKS + "inject_inf_on_rank1_step3")
WORLD2["z3_inf_grad"] = case(
    "--train.steps=5", "--parallel.zero=3", hook=HOOKS + "inject_inf_on_rank1_step3"
)
WORLD2["nan_stop"] = case(
    "--train.steps=8", "--train.max_skipped_steps=3", hook=HOOKS + "nan_loss_on_rank1_from_step3"
)
RESNET = [
    "--model.name=resnet18",
    "--data.dataset=digits",
    "--data.image_size=8",
    "--train.global_batch=8",
    "--train.steps=2",
    "--train.eval_batches=1",
]
WORLD2["resnet"] = {"overrides": RESNET, "hook": "support.hooks:return_buffers"}
WORLD4 = {
    "dp": case(),
    "dp_accum": case("--train.micro_batch=1"),
    "ddp": case(peer=DDP),
}


def _run(cases: dict, nproc: int) -> dict:
    results = run_cases(nproc, list(cases.values()))
    out = {}
    for name, per_rank in zip(cases, results, strict=True):
        for r in per_rank:
            assert "error" not in r or name == "nan_stop", f"{name}: {r['error']}"
        out[name] = per_rank
    return out


@pytest.fixture(scope="module")
def worlds():
    return {1: _run(WORLD1, 1), 2: _run(WORLD2, 2), 4: _run(WORLD4, 4)}


@pytest.mark.parametrize(
    ("nproc", "name"), [(2, "dp"), (2, "dp_accum"), (4, "dp"), (4, "dp_accum"), (1, "ref_accum")]
)
def test_dp_matches_single_process(worlds, nproc, name):
    ref = worlds[1]["ref"][0]
    got = worlds[nproc][name]
    assert len(got[0]["losses"]) == 20
    assert max_rel(got[0]["losses"], ref["losses"]) <= 1e-5
    assert max_param_diff(got[0]["params"], ref["params"]) <= 1e-5
    # every replica ends with identical parameters
    for other in got[1:]:
        assert max_param_diff(other["params"], got[0]["params"]) == 0.0
    # and it actually trained
    assert ref["losses"][-1] < ref["losses"][0] - 0.5


@pytest.mark.parametrize(
    ("nproc", "ours", "peer"), [(2, "dp", "ddp"), (2, "dp_accum", "ddp_accum"), (4, "dp", "ddp")]
)
def test_dp_matches_torch_ddp(worlds, nproc, ours, peer):
    a, b = worlds[nproc][ours][0], worlds[nproc][peer][0]
    assert max_rel(a["losses"], b["losses"]) <= 1e-5
    assert max_param_diff(a["params"], b["params"]) <= 1e-5


def _n_params(result) -> int:
    return sum(p.numel() for p in result["params"].values())


@pytest.mark.parametrize(
    ("nproc", "name", "elem"),
    [
        (2, "dp", 4),
        (4, "dp", 4),
        (2, "bf16_reduce", 2),
        (2, "small_buckets", 4),
        (2, "dp_accum", 4),
    ],
)
def test_dp_comm_bytes_exact(worlds, nproc, name, elem):
    res = worlds[nproc][name][0]
    expected = 2 * (nproc - 1) / nproc * _n_params(res) * elem
    for rec in res["records"]:
        assert rec["comm_bytes"]["dp"] == expected
        assert rec["comm_bytes"]["tp"] == 0 and rec["comm_bytes"]["pp"] == 0


def test_small_buckets_split_and_match(worlds):
    a, b = worlds[2]["small_buckets"][0], worlds[2]["dp"][0]
    assert max_rel(a["losses"], b["losses"][:3]) <= 1e-6


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_same_losses_fewer_activation_bytes(worlds, mode):
    ref, got = worlds[1]["ref"][0], worlds[1][f"recompute_{mode}"][0]
    assert max_rel(got["losses"], ref["losses"]) <= 1e-6
    act = ref["records"][0]["mem_bytes"]["activations"]
    act_rc = got["records"][0]["mem_bytes"]["activations"]
    assert act_rc < act, (mode, act_rc, act)


def test_fp16_inf_on_one_rank_skips_everywhere(worlds):
    per_rank = worlds[2]["fp16_inf"]
    for r in per_rank:
        assert r["skipped"] == [False, False, True, False, False]
        # the scale halves after the overflow and the step after it runs with the new scale
        assert r["scales"][3] == r["scales"][2] / 2
    assert per_rank[0]["params"].keys() == per_rank[1]["params"].keys()
    assert all(
        torch.equal(per_rank[0]["params"][k], per_rank[1]["params"][k])
        for k in per_rank[0]["params"]
    )


def test_batchnorm_buffers_stay_identical_across_replicas(worlds):
    a, b = worlds[2]["resnet"]
    assert a["buffers"].keys() == b["buffers"].keys() and a["buffers"]
    for key in a["buffers"]:
        assert torch.equal(a["buffers"][key], b["buffers"][key]), key
    # and the statistics did move away from their initial values
    assert not torch.equal(
        a["buffers"]["bn1.running_mean"], torch.zeros_like(a["buffers"]["bn1.running_mean"])
    )
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("nan_loss", {"loss_ranks": [1], "grads": []}),
        ("inf_grad", {"loss_ranks": [], "grads": ["embed.weight"]}),
        ("z3_inf_grad", {"loss_ranks": [], "grads": ["embed.weight"]}),
    ],
)
def test_nonfinite_on_one_rank_skips_everywhere_and_is_logged(worlds, name, why):
    """fp32: a NaN loss (finite gradients) or an infinite gradient on rank 1 at step 3 skips
    that step on both ranks, names the rank / tensor, and training goes on."""
    per_rank = worlds[2][name]
    for r in per_rank:
        assert r["skipped"] == [False, False, True, False, False]
        assert r["records"][2]["nonfinite"] == why
        assert all("nonfinite" not in rec for i, rec in enumerate(r["records"]) if i != 2)
        assert all(math.isfinite(x) for i, x in enumerate(r["losses"]) if i != 2)
        assert r["scales"] == [1.0] * 5  # no loss scaling in fp32
    line = format_line(per_rank[0]["records"][2], 5)
    assert "SKIPPED (non-finite " in line and ("rank(s) [1]" in line or "embed.weight" in line)
    assert max_param_diff(per_rank[0]["params"], per_rank[1]["params"]) == 0.0


def test_max_skipped_steps_stops_with_a_diagnosis(worlds):
    for r in worlds[2]["nan_stop"]:
        msg = r["error"].splitlines()[0]
        assert msg.startswith("NonFiniteError: train.max_skipped_steps=3: steps 3-5 were all"), msg
        assert "Step 3: non-finite loss on rank(s) [1]" in msg
        assert "Step 5: non-finite loss on rank(s) [1]" in msg and "Fix:" in msg


def test_synchronised_batchnorm_makes_dp_equal_one_process_with_the_whole_batch():
    """ResNet with BatchNorm: 2 ranks x micro-batch 4 with model.sync_batchnorm (the default)
    give the losses, parameters and running statistics of one process with micro-batch 8;
    unsynchronised, each replica normalises with its own 4 samples and the run differs."""
    hook = {"hook": "support.hooks:return_buffers"}
    # Adam's eps at 1e-3: a weight whose gradient is ~1e-8 (8x8 digits leave many such in
    # the deep stages) moves by lr * g / (|g| + eps), which at the default eps of 1e-8 turns
    # float32 rounding of g into a visible step; here the comparison is of the BatchNorm
    resnet = [*RESNET, "--train.steps=3", "--optim.eps=1e-3"]
    one = run_cases(1, [{"overrides": [*resnet, "--train.micro_batch=8"], **hook}])[0][0]
    synced, plain = run_cases(
        2,
        [
            {"overrides": resnet, **hook},
            {"overrides": [*resnet, "--model.sync_batchnorm=false"], **hook},
        ],
    )
    for res in (one, *synced, *plain):
        assert "error" not in res, res["error"]
    s = synced[0]
    assert s["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert max_param_diff(s["params"], one["params"]) <= 1e-6
    for key in one["buffers"]:
        torch.testing.assert_close(s["buffers"][key], one["buffers"][key], rtol=1e-5, atol=1e-6)
    assert plain[0]["losses"][1:] != pytest.approx(one["losses"][1:], rel=1e-4)
