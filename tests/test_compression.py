"""Gradient compression (`parallel.grad_compression`): bytes on the wire, error feedback,
loss after 200 steps against the uncompressed run, refusals.

One spawned world of 2 gloo ranks trains a small decoder 200 steps seven ways: uncompressed
with seeds 0, 1 and 2 (the seed-to-seed spread is the yardstick), and bf16, fp16 and
PowerSGD with seed 0, and bf16 under ZeRO-2.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.launchers.harness import run_world
from shardwise.parallel.compress import PowerSGD
from shardwise.training.validate import derive

SMALL = [
    "--model.name=tiny",
    "--model.n_layers=2",
    "--model.dim=64",
    "--model.n_heads=2",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=176",
    "--data.seq_len=32",
    "--train.global_batch=8",
    "--train.steps=200",
    "--train.eval_batches=0",
    "--train.lr=3e-3",
]
RUNS = [
    ("none", 0),
    ("none", 1),
    ("none", 2),
    ("bf16", 0),
    ("fp16", 0),
    ("powersgd", 0),
    ("bf16-zero2", 0),  # the 16-bit reduce-scatter of ZeRO-2
]


def _overrides(kind: str, seed: int) -> list[str]:
    wire, _, zero = kind.partition("-zero")
    return [
        *SMALL,
        f"--parallel.grad_compression={wire}",
        f"--parallel.zero={zero or 0}",
        f"--train.seed={seed}",
    ]


@pytest.fixture(scope="module")
def trained():
    cases = [{"overrides": _overrides(kind, seed)} for kind, seed in RUNS]
    out = {}
    for run, per_rank in zip(RUNS, run_world(2, cases), strict=True):
        assert all("error" not in r for r in per_rank), per_rank[0].get("error")
        out[run] = per_rank
    return out


def _late_loss(per_rank) -> float:
    """Mean loss of the last 20 steps (one step's loss is one batch's: noisy)."""
    losses = per_rank[0]["losses"]
    return sum(losses[-20:]) / 20


def test_16_bit_compression_halves_the_dp_bytes_exactly(trained):
    full = trained[("none", 0)][0]["records"]
    for kind in ("bf16", "fp16"):
        recs = trained[(kind, 0)][0]["records"]
        for r, f in zip(recs, full, strict=True):
            assert r["comm_bytes"]["dp"] * 2 == f["comm_bytes"]["dp"]
            assert r["comm_calls"]["dp"] == f["comm_calls"]["dp"]


def test_powersgd_sends_rank_times_rows_plus_columns(trained):
    r, n = 4, 2  # parallel.powersgd_rank default, ranks
    shapes = [tuple(p.shape) for p in trained[("powersgd", 0)][0]["params"].values()]
    elements = 0
    for shape in shapes:
        rows, cols = shape[0], (torch.Size(shape[1:]).numel() if len(shape) > 1 else 1)
        compressed = len(shape) > 1 and r * (rows + cols) * 2 <= rows * cols
        elements += r * (rows + cols) if compressed else rows * cols
    ring = 2 * (n - 1) / n  # comm.py counts an all-reduce of S bytes as 2(n-1)/n * S
    for rec in trained[("powersgd", 0)][0]["records"]:
        assert rec["comm_bytes"]["dp"] == ring * 4 * elements
        assert rec["comm_calls"]["dp"] == 2  # one bucket: P with the vectors, then Q
    full = trained[("none", 0)][0]["records"][-1]["comm_bytes"]["dp"]
    assert full / (ring * 4 * elements) > 10  # the small decoder's matrices compress ~14x


def test_loss_after_200_steps_is_within_the_seed_to_seed_spread(trained):
    """Compression must change the trained loss less than the choice of seed does (the
    yardstick of Vogels et al. 2019: compressed runs reach the uncompressed accuracy within
    its run-to-run spread). A 16-bit wire rounds each gradient element twice per step here
    (the cast, and the sum of 2 ranks in 16 bits; round-to-nearest, relative 2^-8 for bf16,
    2^-11 for fp16), a far smaller change than PowerSGD's rank-4 approximation: it must stay
    within a tenth of that spread, under ZeRO-2's reduce-scatter too.

    PowerSGD's cost depends on the model: on this decoder (vocabulary 4096) rank 4 ended 0.18
    above the uncompressed loss, within the 0.38 spread; on the same decoder with compare.py's
    512-token vocabulary it ended 0.43 above (10%, outside that run's 0.11 spread). The test
    holds for the configuration it names, not for every model (README)."""
    seeds = [_late_loss(trained[("none", s)]) for s in (0, 1, 2)]
    spread = max(seeds) - min(seeds)
    base = seeds[0]
    assert spread > 0.05  # a yardstick that measures something
    for kind in ("bf16", "fp16", "bf16-zero2"):
        assert abs(_late_loss(trained[(kind, 0)]) - base) <= spread / 10, (kind, seeds)
    assert abs(_late_loss(trained[("powersgd", 0)]) - base) <= spread, seeds
    # and every compressed run trained: far below the starting loss
    for run in RUNS:
        assert _late_loss(trained[run]) < trained[run][0]["losses"][0] - 2


def test_every_rank_applies_the_same_update(trained):
    for kind in ("bf16", "fp16", "powersgd"):
        r0, r1 = trained[(kind, 0)]
        for name, p in r0["params"].items():
            assert torch.equal(p, r1["params"][name]), (kind, name)


class _OneRank:
    """A comm over one data-parallel rank: the all-reduce of a sum over one rank is itself."""

    class topo:
        @staticmethod
        def size(dim):
            return 1

    class _Done:
        def wait(self):
            return True

    def all_reduce(self, t, dim, async_op=False):
        return self._Done()


def test_error_feedback_keeps_what_the_low_rank_step_missed():
    """Vogels et al.'s error feedback: what each step's rank-r gradient misses is carried
    into the next, so the updates applied plus the error left sum to the true gradients."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(32, 24))
    applied, true = torch.zeros(32, 24), torch.zeros(32, 24)
    psgd = PowerSGD(rank=2, warm_start=True, seed=0)
    comm = _OneRank()
    for _ in range(5):
        grad = torch.randn(32, 24)
        true += grad
        p.main_grad = grad.clone()
        handle = psgd.launch(comm, 0, p.main_grad.view(-1), [p])
        psgd.finish(comm, [(0, p.main_grad.view(-1), handle)])
        low_rank = torch.linalg.matrix_rank(p.main_grad).item()
        assert low_rank <= 2
        applied += p.main_grad
    error = psgd._state[0].error[0]
    assert torch.allclose(applied + error, true, atol=1e-4)
    assert error.abs().max() > 0.1  # rank 2 of a 32x24 random matrix misses a lot


def test_a_non_finite_gradient_does_not_poison_the_steps_after_it():
    """Its step is skipped; the error memory and the warm-start Q must not carry the NaN."""
    p = torch.nn.Parameter(torch.zeros(32, 24))
    psgd, comm = PowerSGD(rank=2, warm_start=True, seed=0), _OneRank()
    for grad in (torch.full((32, 24), float("nan")), torch.randn(32, 24)):
        p.main_grad = grad.clone()
        handle = psgd.launch(comm, 0, p.main_grad.view(-1), [p])
        psgd.finish(comm, [(0, p.main_grad.view(-1), handle)])
    assert torch.isfinite(p.main_grad).all() and p.main_grad.abs().max() > 0
    assert torch.isfinite(psgd._state[0].error[0]).all()


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--parallel.zero=1"], "parallel.zero=1 reduce-scatters each rank's slice"),
        (["--precision.reduce=bf16"], "--precision.reduce=fp32"),
        (["--parallel.powersgd_rank=0"], "parallel.powersgd_rank=0 must be >= 1"),
        (["--precision.compute=fp16"], "precision.compute=fp16 scales the gradients"),
    ],
)
def test_compression_it_cannot_do_is_refused_with_the_fix(overrides, needle):
    cfg = load_config(None, ["--parallel.grad_compression=powersgd", *overrides])
    with pytest.raises(ConfigError, match="Fix:") as info:
        derive(cfg, 2)
    assert needle in str(info.value)


def test_compression_on_one_data_parallel_rank_says_it_does_nothing():
    from shardwise.job.explain import explain_record
    from shardwise.plan.hardware import get_hardware

    hw = get_hardware("cpu", calibrate=False)
    cfg = load_config(None, ["--parallel.grad_compression=bf16"])
    assert any("has no effect here: dp=1" in w for w in explain_record(cfg, 1, hw)["warnings"])
    assert not any("grad_compression" in w for w in explain_record(cfg, 2, hw).get("warnings", []))
    tp2 = load_config(None, ["--parallel.grad_compression=bf16", "--parallel.tp=2"])
    assert any("dp=1" in w for w in explain_record(tp2, 2, hw)["warnings"])


def test_plan_ranks_the_asked_compression_beside_the_uncompressed_layouts():
    """`plan --parallel.grad_compression=K` searches ZeRO-0 layouts both ways (and ZeRO-1-3
    uncompressed); on 8 A100 nodes on 10 Gb/s Ethernet per GPU (a 20x slower network than
    HDR InfiniBand: a ring's traffic crosses all 8 NICs of a node, so 10x no longer starves it)
    PowerSGD's 1/50 of the bytes wins for a data-parallel-heavy job, and its predicted dp
    bytes follow the formula."""
    from shardwise.job.predict import job_from_config
    from shardwise.plan.hardware import get_hardware
    from shardwise.plan.search import search

    hw = get_hardware("a100-80gb", calibrate=False)
    hw = hw.with_overrides(inter_bw=hw.inter_bw / 20)
    args = ["--model.name=1b", "--data.seq_len=2048", "--train.global_batch=64"]
    plain = search(job_from_config(load_config(None, args), hw, 64))
    assert {c["compression"] for c in plain.candidates} == {"none"}
    cfg = load_config(None, [*args, "--parallel.grad_compression=powersgd"])
    result = search(job_from_config(cfg, hw, 64))
    wires = {(c["zero"], c["compression"]) for c in result.candidates}
    assert (0, "powersgd") in wires and (0, "none") in wires
    assert all(z == 0 for z, w in wires if w == "powersgd")
    best = {
        w: min(c["step_time_s"] for c in result.candidates if c["compression"] == w)
        for w in ("none", "powersgd")
    }
    assert best["powersgd"] < best["none"]
    same = [c for c in result.candidates if c["zero"] == 0 and c["dp"] > 1]
    for c in same:
        twin = next(
            (
                d
                for d in same
                if d["compression"] != c["compression"]
                and all(d[k] == c[k] for k in ("tp", "pp", "dp", "micro_batch", "recompute"))
            ),
            None,
        )
        if twin is not None and c["compression"] == "powersgd":
            assert c["comm_bytes"]["dp"] < twin["comm_bytes"]["dp"] / 10
