"""The `cpu` time model: measured kernel times at a layout's own shapes (plan/kernels.py)
composed into a step, and the FLOP model when a shape is too large to time here."""

import pytest

from shardwise.models import ModelSpec
from shardwise.plan import kernels, traffic
from shardwise.plan import time as tm
from shardwise.plan.hardware import get_hardware
from shardwise.plan.layout import Job, Layout
from shardwise.plan.memory import predict_memory

SPEC = ModelSpec("decoder", 4, 64, 4, 2, 128, 512, 32)


def _job(measured: bool) -> Job:
    hw = get_hardware("cpu", calibrate=False).with_overrides(measured_kernels=measured)
    return Job(SPEC, hw, 2, seq_len=32, global_batch=8, precision="fp32", reduce="fp32")


def test_step_composes_the_measured_kernels(monkeypatch):
    """compute = micro-batches x (blocks of the busiest stage x block + head and loss) and the
    optimizer = local fp32 elements x the measured AdamW rate, with the shapes the rank runs."""
    calls = []

    def block(spec, tp, tokens, seq_len, precision, recompute):
        calls.append((tp, tokens, seq_len, precision, recompute))
        return 0.01

    monkeypatch.setattr(kernels, "block_seconds", block)
    monkeypatch.setattr(kernels, "head_seconds", lambda dim, vocab, tokens, prec: 0.003)
    monkeypatch.setattr(kernels, "optimizer_seconds_per_element", lambda: 1e-9)
    job = _job(True)
    lay = Layout(tp=2, dp=1, micro_batch=2, recompute="selective", sp=True)
    mem = predict_memory(job, lay)
    parts = tm.step_time(job, lay, mem)
    m = lay.micro_batches(job)
    assert calls[-1] == (2, 64, 32, "fp32", "selective")
    assert parts["compute_s"] == pytest.approx(m * (4 * 0.01 + 0.003))
    assert parts["optimizer_s"] == pytest.approx(mem["optimizer"] / 8 * 1e-9)
    pp = Layout(pp=2, dp=1, micro_batch=2, pp_schedule="gpipe")
    job_split = Job(**{**job.__dict__, "pp_split": "1,3"})
    parts = tm.step_time(job_split, pp, predict_memory(job_split, pp))
    assert parts["compute_s"] == pytest.approx(pp.micro_batches(job) * (3 * 0.01 + 0.003))


def test_nominal_hardware_uses_the_flop_model(monkeypatch):
    def fail(*args):
        raise AssertionError("kernels timed for uncalibrated hardware")

    monkeypatch.setattr(kernels, "block_seconds", fail)
    job, lay = _job(False), Layout(dp=2, micro_batch=2)
    assert tm.step_time(job, lay, predict_memory(job, lay))["compute_s"] > 0


def test_kernels_time_the_shard_shapes(monkeypatch, tmp_path):
    """Grouped-query attention with more tp ranks than kv heads (replicated kv) and GPT-2 run
    as shards; a block too large to time here falls back to the FLOP model (None); the times
    are kept for the next process."""
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_memo", None)
    assert kernels.block_seconds(SPEC, 4, 64, 32, "fp32", "full") > 0
    gpt2 = ModelSpec("gpt2", 2, 64, 4, 4, 256, 512, 32)
    assert kernels.block_seconds(gpt2, 2, 64, 32, "bf16", "none") > 0
    assert kernels.head_seconds(64, 256, 64, "fp32") > 0
    big = ModelSpec("decoder", 2, 8192, 64, 8, 28672, 128256, 4096)
    assert kernels.block_seconds(big, 1, 8192, 4096, "bf16", "none") is None
    assert kernels.head_seconds(8192, 128256, 8192, "bf16") is None
    kept = (tmp_path / "kernels-cpu.json").read_text()
    assert "block_seconds" in kept and "head_seconds" in kept
    monkeypatch.setattr(kernels, "_memo", None)  # a new process reads them back
    key = "head_seconds(64, 256, 64, 'fp32')"
    assert kernels.head_seconds(64, 256, 64, "fp32") == kernels._stored()[key]
    kernels.clear()  # a fresh calibration: every time is measured again, on disk too
    monkeypatch.setattr(kernels, "_memo", None)
    assert kernels._stored() == {}


def test_collective_kinds_cost_what_the_transport_charges():
    """ZeRO-1 over 2 ranks: a reduce-scatter of the padded gradients and an all-gather of
    the updated slices, each half of the bytes; a transport whose reduce-scatter costs 3x and
    all-gather 2x an all-reduce per ring byte (gloo measures in that range) makes exactly that
    much more communication time; plain DP (all-reduce only) is unchanged."""
    job = _job(False)
    z1, dp = Layout(dp=2, zero=1, micro_batch=2), Layout(dp=2, micro_batch=2)
    kinds = traffic.traffic_by_kind(job, z1)["dp"]
    assert kinds["all_reduce"] == 0
    assert kinds["reduce_scatter"] == kinds["all_gather"] > 0  # fp32 gradients and params
    assert sum(kinds.values()) == traffic.traffic(job, z1)["dp"]
    costly = job.hardware.with_overrides(collective_cost={"reduce_scatter": 3, "all_gather": 2})
    job2 = Job(**{**job.__dict__, "hardware": costly})
    bw = job.hardware.intra_bw * job.hardware.comm_eff
    for lay, extra in ((z1, (2 * kinds["reduce_scatter"] + kinds["all_gather"]) / bw), (dp, 0)):
        mem = predict_memory(job, lay)
        before = tm.step_time(job, lay, mem)["dp_comm_s"]
        after = tm.step_time(job2, lay, mem)["dp_comm_s"]
        assert after - before == pytest.approx(extra)


def test_calibration_measures_gloo_per_collective_kind():
    """Two gloo ranks in two processes: the all-reduce's bandwidth and latency, and what a
    reduce-scatter and an all-gather cost per ring byte relative to it (positive, finite)."""
    from shardwise.plan.calibrate import _gloo

    out = _gloo(nbytes=2**20, reps=3, calls=20)
    assert out["gloo_bw"] > 0 and 0 < out["gloo_latency"] < 1
    for key in ("gloo_rs_cost", "gloo_ag_cost"):
        assert 0 < out[key] < 100, (key, out[key])


def test_gloo_calibration_retries_when_noise_hides_the_bandwidth(monkeypatch):
    """When the bigger all-reduce does not come out slower than the small one (a noisy host),
    the fit would divide by ~0: measure again, and if it never grows, bound the bandwidth by
    the big all-reduce's bytes over its whole time."""
    from shardwise.plan import calibrate

    flat = {"latency": 1e-4, "all_reduce_small": 2e-3, "all_reduce": 2e-3}
    flat |= {"reduce_scatter": 2e-3, "all_gather": 2e-3}
    good = dict(flat, all_reduce=5e-3)
    runs = [flat, good]
    monkeypatch.setattr(calibrate, "_gloo_timings", lambda *a: runs.pop(0))
    out = calibrate._gloo(nbytes=2**20)
    assert not runs  # measured twice
    assert out["gloo_bw"] == pytest.approx((2**20 * 15 / 16) / 3e-3)
    monkeypatch.setattr(calibrate, "_gloo_timings", lambda *a: flat)
    assert calibrate._gloo(nbytes=2**20)["gloo_bw"] == pytest.approx(2**20 / 2e-3)
