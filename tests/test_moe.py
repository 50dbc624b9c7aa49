"""The MoE decoder (models/moe.py, training/moe.py): the grouped expert GEMM against a loop, the
layer against a token-by-token reference, and training under data parallelism and ZeRO against
the single process, balance loss and bias balancing on.

Why these: the grouped kernel and the capacity layout are index arithmetic a reference written
the slow way checks exactly; the balance statistics and the bias are state every rank must
agree on, so layout invariance is checked on the records and buffers, not only the losses."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.launchers.harness import run_named_worlds
from shardwise.models import init_weights
from shardwise.models.moe import MoE, MoEDecoder, expert_matmul, grouped_mm_runs, moe_layers
from shardwise.models.presets import preset
from shardwise.models.spec import spec_from_config
from support.compare import case, max_param_diff, max_rel

MOE = ["--model.name=moe-tiny", "--train.steps=5"]
BALANCE = ["--train.moe_aux_loss=0.01", "--train.moe_bias_balance=0.01"]
CAPACITY = ["--model.capacity_factor=1.0", "--model.n_shared_experts=1"]
BUFFERS = {"hook": "support.hooks:return_buffers"}
SKEW = {"hook": "test_moe:skew_router"}
SKEWED = [*MOE, "--train.steps=12", "--optim.warmup_steps=1"]
WORLD1 = {
    "ref": case(*MOE, *BALANCE, **BUFFERS),
    "ref_recompute": case(*MOE, *BALANCE, "--memory.recompute=full", **BUFFERS),
    "ref_capacity": case(*MOE, *BALANCE, *CAPACITY),
    "skew_off": case(*SKEWED, **SKEW),
    "skew_on": case(*SKEWED, "--train.moe_bias_balance=0.02", **SKEW),
}
WORLD2 = {
    "z0": case(*MOE, *BALANCE, **BUFFERS),
    "z1": case(*MOE, *BALANCE, "--parallel.zero=1", **BUFFERS),
    "z3": case(*MOE, *BALANCE, "--parallel.zero=3", **BUFFERS),
    # accumulation: other micro-batches than the single process's, same drops (per sequence)
    "capacity": case(*MOE, *BALANCE, *CAPACITY, "--train.micro_batch=2"),
}


def skew_router(run) -> None:
    """A skewed start: expert 0's bias makes every token choose it (2x the mean load)."""
    for layer in moe_layers(run.model):
        layer.expert_bias[0] = 0.2


@pytest.fixture(scope="module")
def worlds():
    return run_named_worlds({1: WORLD1, 2: WORLD2})


# --- the layer ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_per_expert_loop(dtype):
    """torch._grouped_mm over uneven groups, one of them empty, equals one matmul per expert:
    forward and both gradients (fp32 to 1e-6; bf16 runs and agrees to its precision)."""
    assert grouped_mm_runs(torch.device("cpu"), dtype)  # CPU: both dtypes take the kernel
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2])
    xs0 = torch.randn(int(counts.sum()), 16, generator=g).to(dtype)
    w0 = torch.randn(4, 16, 24, generator=g).to(dtype)
    out = {}
    for grouped in (True, False):
        xs, w = xs0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = expert_matmul(xs, w, counts, grouped=grouped)
        y.float().pow(2).sum().backward(retain_graph=True)  # a non-trivial gradient
        (y.sum() * 0).backward()  # and the expanded one a .sum() gives
        out[grouped] = (y.float(), xs.grad.float(), w.grad.float())
    tol = 1e-6 if dtype == torch.float32 else 5e-2
    for a, b in zip(out[True], out[False], strict=True):
        assert ((a - b).abs() / (b.abs() + 1)).max() <= tol
    assert out[True][2][1].abs().max() == 0  # the empty expert's gradient is zero


def _reference(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The layer written the slow way: every token of every sequence in position order, its
    top-k experts one by one, a capacity counter per (sequence, expert)."""
    b, s, _ = x.shape
    e, k = layer.n_experts, layer.top_k
    cap = math.ceil(layer.capacity_factor * s * k / e) if layer.capacity_factor else None
    out, dropped = torch.zeros_like(x), 0
    for i in range(b):
        used = [0] * e
        for j in range(s):
            t = x[i, j]
            logits = layer.router.weight @ t
            scores = logits.sigmoid() if layer.sigmoid else logits.softmax(-1)
            chosen = (scores + layer.expert_bias).topk(k).indices.tolist()
            total = sum(scores[c] for c in chosen)
            for c in chosen:
                if cap is not None and used[c] >= cap:
                    dropped += 1
                    continue
                used[c] += 1
                weight = scores[c] / total if layer.sigmoid else scores[c]
                h = F.silu(t @ layer.w1[c]) * (t @ layer.w3[c])
                out[i, j] += weight * (h @ layer.w2[c])
            if layer.shared is not None:
                out[i, j] += layer.shared(t)
    return out, dropped


@pytest.mark.parametrize(
    "router,shared,capacity", [("softmax", 0, 0.0), ("sigmoid", 1, 0.0), ("softmax", 1, 0.75)]
)
def test_layer_equals_a_token_by_token_reference(router, shared, capacity):
    """Dropless (and with a capacity: the same tokens dropped, counted) the layer equals the
    reference; the bias moves the choice only (a large one on expert 3 puts it everywhere)."""
    spec = dataclasses.replace(
        preset("moe-tiny"),
        dim=32,
        n_heads=2,
        n_kv_heads=2,
        ffn_dim=24,
        router=router,
        n_shared_experts=shared,
        capacity_factor=capacity,
    )
    model = MoEDecoder(spec)
    init_weights(model, 0)
    layer = model.blocks[0].mlp
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(1))
    for bias in (0.0, 0.5):
        with torch.no_grad():
            layer.expert_bias[3] = bias
        got = layer(x)
        want, dropped = _reference(layer, x)
        assert (got - want).abs().max() <= 1e-6
        assert int(layer.last[layer.n_experts]) == dropped
        assert (dropped > 0) == (capacity > 0)
        if bias:
            assert int(layer.last[3]) == 30  # every token chose expert 3


def test_a_checkpointed_layer_runs_its_first_forward_in_a_fresh_process(monkeypatch):
    """The grouped-GEMM probe runs at a layer's first forward; under non-reentrant
    recomputation that forward is watched by saved-tensor hooks, and a probe counted there but
    cached at the replay made the two disagree (a CheckpointError at the first backward of
    `memory.recompute=full`). The probe now runs apart; the layer's gradient equals the plain
    run's, and the replay leaves no balance-loss graph behind once the step is tallied."""
    from torch.utils.checkpoint import checkpoint

    from shardwise.models import moe as moe_module
    from shardwise.training.moe import ExpertTally

    model = MoEDecoder(preset("moe-tiny"))
    init_weights(model, 0)
    layer = model.blocks[0].mlp
    x = torch.randn(2, 8, layer.w1.shape[1], generator=torch.Generator().manual_seed(2))
    grads = []
    for recompute in (True, False):
        monkeypatch.setattr(moe_module, "_GROUPED", {})  # as in a new process
        xi = x.clone().requires_grad_()
        y = checkpoint(layer, xi, use_reentrant=False) if recompute else layer(xi)
        y.square().sum().backward()
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1])
    cfg = load_config(None, ["--train.moe_aux_loss=0.01"])
    tally = ExpertTally(model, cfg.train)
    layer.aux = torch.ones((), requires_grad=True)  # as a replay in backward leaves it

    class _Comm:
        def all_reduce(self, t, dim, control=False):
            return t

    tally.after_step(_Comm(), skipped=False)
    assert all(m.aux is None for m in moe_layers(model))


def test_config_keys_build_and_refuse():
    """model.n_experts turns a decoder preset into MoE; the MoE keys on a dense model and
    tensor parallelism are refused with the key named."""

    def spec(*args):
        return spec_from_config(load_config(None, list(args)))

    moe = spec("--model.name=tiny", "--model.n_experts=8", "--model.top_k=1")
    assert (moe.arch, moe.n_experts, moe.top_k) == ("moe", 8, 1)
    assert spec("--model.name=moe-tiny", "--model.n_shared_experts=2").n_shared_experts == 2
    for args in (["--model.top_k=2"], ["--train.moe_aux_loss=0.01"]):
        with pytest.raises(ConfigError, match="mixture-of-experts"):
            spec("--model.name=tiny", *args)
    with pytest.raises(ConfigError, match="top_k"):
        spec("--model.name=moe-tiny", "--model.top_k=5")
    from shardwise.training.validate import derive

    # tp leaves the experts whole: without sp every tp rank would compute every token's
    with pytest.raises(ConfigError, match=r"parallel.tp=2 .*needs parallel.sp=true.*Fix:"):
        derive(load_config(None, ["--model.name=moe-tiny", "--parallel.tp=2"]), 2)


# --- training -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["z0", "z1", "z3"])
def test_data_parallel_and_zero3_reproduce_the_single_process(worlds, name):
    """dp=2 (ZeRO-0, 1 and 3), balance loss and bias balancing on: the losses, parameters,
    the routing biases and the per-layer loads and balance losses of every step are the
    single process's (the loads are global counts, so they are equal exactly)."""
    ref, got = worlds[1]["ref"][0], worlds[2][name]
    assert max_rel(got[0]["losses"], ref["losses"]) <= 1e-5
    assert max_param_diff(got[0]["params"], ref["params"]) <= 1e-5
    biases = {n: b for n, b in ref["buffers"].items() if n.endswith("expert_bias")}
    assert biases and any(b.abs().max() > 0 for b in biases.values())  # the bias moved
    for rank in got:
        assert max_param_diff({n: rank["buffers"][n] for n in biases}, biases) <= 1e-7
    for a, b in zip(got[0]["records"], ref["records"], strict=True):
        assert a["moe_load_max_mean"] == b["moe_load_max_mean"]
        assert abs(a["moe_aux_loss"] - b["moe_aux_loss"]) <= 1e-6
    print("dp2", name, "max loss rel diff", max_rel(got[0]["losses"], ref["losses"]))


def test_recomputation_changes_nothing(worlds):
    """memory.recompute=full replays each block's forward in backward: the statistics are read
    once per forward, so losses, parameters and biases are those of the plain run."""
    ref, got = worlds[1]["ref"][0], worlds[1]["ref_recompute"][0]
    assert max_rel(got["losses"], ref["losses"]) <= 1e-6
    assert max_param_diff(got["params"], ref["params"]) <= 1e-6
    assert [r["moe_load_max_mean"] for r in got["records"]] == [
        r["moe_load_max_mean"] for r in ref["records"]
    ]


def test_dropped_tokens_do_not_depend_on_the_layout(worlds):
    """A capacity per sequence: dp=2 with micro-batches of 2 drops exactly the tokens the
    single process drops (micro-batches of 8), step by step."""
    ref, got = worlds[1]["ref_capacity"][0], worlds[2]["capacity"][0]
    dropped = [r["moe_dropped"] for r in ref["records"]]
    assert [r["moe_dropped"] for r in got["records"]] == dropped
    assert sum(map(sum, dropped)) > 0
    assert max_rel(got["losses"], ref["losses"]) <= 1e-5
    print("dropped per step and layer", dropped)


def test_bias_balancing_evens_a_skewed_start(worlds):
    """From a start where every token picks expert 0, the auxiliary-loss-free bias brings the
    max/mean load down; without it the skew stays."""
    off = [r["moe_load_max_mean"] for r in worlds[1]["skew_off"][0]["records"]]
    on = [r["moe_load_max_mean"] for r in worlds[1]["skew_on"][0]["records"]]
    print("max/mean load per step, off:", off, "on:", on)
    assert min(off[0]) == 2.0 and on[0] == off[0]  # expert 0 takes every token at first
    # the last half: the bias overshoots by a rate, and 4 experts over 256 tokens are never
    # even (max/mean 1.1-1.3 when balanced)
    late_on, late_off = [sum(s) / len(s) for s in on[6:]], [sum(s) / len(s) for s in off[6:]]
    assert max(late_on) < 1.75 and sum(late_on) / 6 < 1.5 < 1.9 < min(late_off)
