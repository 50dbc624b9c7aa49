"""Host syncs in `shardwise profile`: the counter (profile/host_syncs.py) names each read of
device values by its call site, summary.json lists the engine's own per rank, and a user's
`.item()` in a model's forward is a finding.

The profiles run as cases of one spawned world of 2 gloo ranks (the capture a `shardwise
profile` run makes); the analysis then runs here, as the command's does after its ranks end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.config import load_config
from shardwise.launchers.harness import run_world
from shardwise.profile import host_syncs
from shardwise.profile.host_syncs import HostSyncs
from support.profile_cases import BASE

WARMUP, MEASURED = 1, 2
PROFILE = [
    f"--profile.steps={MEASURED}",
    f"--profile.warmup={WARMUP}",
    f"--train.steps={WARMUP + MEASURED + 1}",
]
USER = Path(__file__).resolve().parent / "user" / "models.py"
# the user's MLP on the digits data: 16 samples a step, 2 ranks, micro-batches of 4
WATCHED = [
    f"--model.name={USER}:watched_mlp",
    "--data.dataset=digits",
    "--train.global_batch=16",
    "--train.micro_batch=4",
    "--train.eval_batches=0",
    "--log.tensorboard=false",
]
FORWARDS = 16 // 2 // 4  # forwards per rank and step
# the engine's own syncs per step (tests/test_optim_step.py names the same two)
ENGINE = {"optim/__init__.py:step": 1.0, "training/loop.py:_max_over_ranks": 1.0}
HOST_SIDE = ("data/sampler.py:", "models/dropout.py:")  # host tensors: device syncs nowhere
CASES = {
    "plain": BASE,
    "off": [*BASE, "--profile.host_syncs=false"],
    "watched": WATCHED,
}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """name -> the summary `shardwise profile` writes for that case."""
    from shardwise.cli.profile import summarise

    root = tmp_path_factory.mktemp("syncs")
    cases = [
        {"overrides": [*extra, *PROFILE, f"--run.dir={root / name}"]}
        for name, extra in CASES.items()
    ]
    results = run_world(2, cases)
    out = {}
    for name, case, per_rank in zip(CASES, cases, results, strict=True):
        assert all("error" not in r for r in per_rank), per_rank[0].get("error")
        out[name] = summarise(load_config(None, case["overrides"]), 2)
    out["root"] = root
    return out


def _device_sites(by_site: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in by_site.items() if not k.startswith(HOST_SIDE)}


def test_the_summary_lists_the_engines_two_syncs_by_call_site(profiled):
    summary = profiled["plain"]
    for rank in summary["ranks"]:
        syncs = rank["host_syncs"]
        assert _device_sites(syncs["by_site"]) == ENGINE, (rank["rank"], syncs)
        assert syncs["unexpected"] == {}
        assert len(syncs["per_step"]) == MEASURED
        assert syncs["total"] == sum(syncs["per_step"])
        assert all(n >= len(ENGINE) for n in syncs["per_step"])
    assert all(f["cause"] != "host_syncs" for f in summary["findings"]), summary["findings"]
    # the file on disk says the same, and the report shows one line per rank
    on_disk = json.loads((profiled["root"] / "plain" / "summary.json").read_text())
    assert on_disk["ranks"][0]["host_syncs"] == summary["ranks"][0]["host_syncs"]
    report = (profiled["root"] / "plain" / "report.md").read_text()
    assert "## Host syncs" in report
    assert "the engine's 2 (optim/__init__.py:step 1, training/loop.py:_max_over_ranks 1)" in report
    section = report.split("## Host syncs", 1)[1].split("\n## ", 1)[0]
    assert "rank 1: " in section and "others" not in section  # (a straggler finding may say it)


def test_a_users_item_in_forward_is_named_in_a_finding(profiled):
    summary = profiled["watched"]
    for rank in summary["ranks"]:
        syncs = rank["host_syncs"]
        extra = {k: v for k, v in _device_sites(syncs["by_site"]).items() if k not in ENGINE}
        assert len(extra) == 1 and next(iter(extra)).endswith("user/models.py:forward"), extra
        assert list(extra.values()) == [FORWARDS]
        assert syncs["unexpected"] == extra
        assert {k: syncs["by_site"][k] for k in ENGINE} == ENGINE
    found = [f for f in summary["findings"] if f["cause"] == "host_syncs"]
    assert len(found) == 1, summary["findings"]
    f = found[0]
    assert list(f["sites"]) == list(extra)
    assert f"they call): {next(iter(extra))} ({FORWARDS} per step)" in f["evidence"]
    assert "shardwise's own" not in f["evidence"]
    # unpriced: no config change, no predicted gain, and the evidence says why
    assert f["remedy"] == [] and f["predicted_gain"] == 0 and "not priced" in f["evidence"]


def test_profile_host_syncs_false_leaves_the_counter_off(profiled):
    summary = profiled["off"]
    assert all("host_syncs" not in r for r in summary["ranks"])
    assert "## Host syncs" not in (profiled["root"] / "off" / "report.md").read_text()


def test_the_finding_tells_user_code_from_shardwises_and_ignores_host_side_reads():
    """Sites outside the engine's two and the host-side reads make the finding, at the most
    any rank made per step; the package's own are named apart (no setting removes them)."""
    from shardwise.job.remedy import _host_syncs

    def rank(by_site: dict[str, float]) -> dict:
        return {"host_syncs": host_syncs.summary([by_site])}

    plain = {**ENGINE, "data/sampler.py:global_indices": 3, "models/dropout.py:samples": 2}
    assert _host_syncs([rank(plain), rank(plain)], 0.1) is None
    # an MoE model's one read of its statistics is the engine's own: no finding
    assert _host_syncs([rank({**plain, "training/moe.py:after_step": 1})], 0.1) is None
    moe = {**plain, "parallel/expert_comm.py:counts": 1}  # (a site of the package's own)
    user = {**plain, "train_mine.py:forward": 2}
    f = _host_syncs([rank(moe), rank(user), rank({**user, "train_mine.py:forward": 3})], 0.1)
    assert f["sites"] == {"train_mine.py:forward": 3, "parallel/expert_comm.py:counts": 1}
    assert "they call): train_mine.py:forward (3 per step)" in f["evidence"]
    assert (
        "own code (no setting removes them): parallel/expert_comm.py:counts (1 per step)"
        in (f["evidence"])
    )
    assert (f["predicted_step_s"], f["predicted_gain"], f["remedy"]) == (0.1, 0, [])


def _reads(x: torch.Tensor) -> None:
    x.sum().item()  # a scalar read
    float(x[0])  # another
    x.tolist()  # not dispatched: patched while counting
    _ = x[x > 0]  # a boolean mask sizes its result by the values


def _sized(x: torch.Tensor) -> None:
    torch.nonzero(x)
    x.unique()  # (torch.unique inside: one sync, counted once)
    torch.where(x > 0)  # one argument: the indices of the true entries
    x.clone()[x < 0] = 0.0  # a boolean-mask assignment
    int(x[0]) + bool(x[1])


def _none(x: torch.Tensor) -> torch.Tensor:
    """No read: an integer index, a three-argument where, a cast, a copy between host
    tensors (on CPU `.cpu()` is no copy at all)."""
    y = x.to(torch.float64).cpu() + torch.where(x > 0, x, 0.0)
    return (x * 2).sum() + x[torch.tensor([0, 1])].sum() + y.copy_(x).sum()


def test_the_counter_names_each_read_by_its_function_and_nothing_else():
    x = torch.tensor([1.0, -2.0, 3.0])
    original = torch.Tensor.tolist
    with HostSyncs() as syncs:
        _reads(x)
        _sized(x)
        _none(x)
        first = syncs.take()
        _reads(x)
        second = syncs.take()
    name = "test_profile_host_syncs.py:"
    assert {k.rsplit("/", 1)[-1]: v for k, v in first.items()} == {
        name + "_reads": 4,
        name + "_sized": 6,
    }
    assert {k.rsplit("/", 1)[-1]: v for k, v in second.items()} == {name + "_reads": 4}
    # after the counter: tolist is torch's own again and nothing more is counted
    assert torch.Tensor.tolist is original
    x.tolist()
    assert syncs.take() == {}
