"""Memory accounting is exact by category and `explain` predicts it; bf16 trains like fp32."""

import pytest

from shardwise.config import load_config
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_side_by_side

pytestmark = pytest.mark.slow

SMALL = [
    "--model.n_layers=2",
    "--data.seq_len=32",
    "--train.global_batch=8",
    "--train.steps=2",
    "--train.eval_batches=0",
]
# 200 steps of the tiny decoder (all 4 layers) at a short sequence length.
LONG = [
    "--data.seq_len=32",
    "--train.global_batch=8",
    "--train.steps=200",
    "--train.eval_every=0",
    "--train.eval_batches=0",
]
CASES = {
    "fp32": SMALL,
    "bf16": [*SMALL, "--precision.compute=bf16", "--precision.reduce=bf16"],
    "bf16_fp32_reduce": [*SMALL, "--precision.compute=bf16"],
    "fp32_long": LONG,
    "bf16_long": [*LONG, "--precision.compute=bf16", "--precision.reduce=bf16"],
}


@pytest.fixture(scope="module")
def results():
    # the two long runs side by side (one core each), the short ones after fp32's
    names = [["fp32_long", "fp32", "bf16", "bf16_fp32_reduce"], ["bf16_long"]]
    groups = run_side_by_side([[{"overrides": CASES[n]} for n in g] for g in names])
    out = dict(zip([n for g in names for n in g], [r for g in groups for r in g], strict=True))
    res = {}
    for name, per_rank in out.items():
        assert "error" not in per_rank[0], per_rank[0].get("error")
        res[name] = per_rank[0]
    return res


@pytest.mark.parametrize(
    ("name", "param_b", "grad_b", "master_b"),
    [("fp32", 4, 4, 0), ("bf16", 2, 2, 4), ("bf16_fp32_reduce", 2, 4, 4)],
)
def test_model_state_bytes_exact(results, name, param_b, grad_b, master_b):
    res = results[name]
    n = sum(p.numel() for p in res["params"].values())
    n_tensors = len(res["params"])
    mem = res["records"][-1]["mem_bytes"]
    assert mem["params"] == param_b * n
    assert mem["grads"] == grad_b * n
    assert mem["master"] == master_b * n
    # AdamW: exp_avg + exp_avg_sq in fp32, plus one fp32 step counter per tensor
    assert mem["optimizer"] == 8 * n + 4 * n_tensors
    # mixed-precision Adam with bf16 gradients: the 16 bytes/parameter of the ZeRO paper
    if name == "bf16":
        model_states = sum(mem[k] for k in ("params", "grads", "master", "optimizer"))
        assert model_states == 16 * n + 4 * n_tensors
    states = sum(mem[k] for k in ("params", "grads", "master", "optimizer", "buffers"))
    assert mem["total"] == states + mem["activations"]


@pytest.mark.parametrize("name", ["fp32", "bf16", "bf16_fp32_reduce"])
def test_explain_predicts_measured_memory(results, name):
    cfg = load_config(None, CASES[name])
    predicted = explain_record(cfg, 1)["mem_bytes"]
    measured = results[name]["records"][-1]["mem_bytes"]
    # every category exactly: the planner's activation formula models our blocks and the
    # loader's (B, S+1) token window byte for byte
    for key in ("params", "grads", "master", "optimizer", "buffers", "activations", "total"):
        assert predicted[key] == measured[key], key


def test_bf16_trains_like_fp32(results):
    fp32 = results["fp32_long"]["losses"]
    bf16 = results["bf16_long"]["losses"]
    assert fp32[-1] < fp32[0] - 2.0  # it really trained
    # compare smoothed final losses (mean of the last 10 steps) within 2%
    f, b = sum(fp32[-10:]) / 10, sum(bf16[-10:]) / 10
    assert abs(b - f) / f <= 0.02, (f, b)
