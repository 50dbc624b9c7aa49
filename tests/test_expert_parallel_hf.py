"""Expert parallelism (parallel.ep) of Hugging Face MoE checkpoints (`model.name=hf`): the
stacked experts of transformers' Mixtral, Qwen2-MoE (with its shared expert), Qwen3-MoE and
OLMoE classes split over the ep ranks, each rank reading only its experts' rows from the
per-expert tensors, the rows exchanged inside our experts forward (models/hf/experts.py).
fp32, the tiny checkpoints of tests/test_hf_moe.py (4 experts): ep 2 on 2 ranks (ZeRO-0 and
ZeRO-3) and ep 4 on 4 ranks (one expert a rank) must reproduce one process's losses,
parameters (gathered to full shape) and expert loads; a dense checkpoint is refused."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_named_worlds
from shardwise.plan.hardware import get_hardware
from shardwise.training.validate import derive
from support.compare import assert_reproduces
from test_hf_moe import STEPS, _lm, world  # noqa: F401 (the checkpoints' fixture)

pytestmark = pytest.mark.slow

EP2 = {  # name: (checkpoint, extra overrides on 2 ranks)
    "mixtral_ep2": ("mixtral", ["--parallel.ep=2"]),
    "qwen2_moe_ep2_z3": ("qwen2_moe", ["--parallel.ep=2", "--parallel.zero=3"]),
    "olmoe_ep2_z1": ("olmoe", ["--parallel.ep=2", "--parallel.zero=1"]),
    "qwen3_moe_ep2": ("qwen3_moe", ["--parallel.ep=2"]),
}

EP4 = {  # name: (checkpoint, extra overrides on 4 ranks)
    "mixtral_ep4": ("mixtral", ["--parallel.ep=4"]),
    "qwen2_moe_ep4_z3": ("qwen2_moe", ["--parallel.ep=4", "--parallel.zero=3"]),
}


@pytest.fixture(scope="module")
def runs(world):  # noqa: F811
    one = {ckpt: {"overrides": _lm(world, ckpt, *STEPS)} for ckpt, _ in EP2.values()}
    two = {n: {"overrides": _lm(world, ckpt, *STEPS, *x)} for n, (ckpt, x) in EP2.items()}
    four = {n: {"overrides": _lm(world, ckpt, *STEPS, *x)} for n, (ckpt, x) in EP4.items()}
    kept = ["--checkpoint.every=4", f"--run.dir={world['root'] / 'run_ep2'}"]
    two["mixtral_ep2"]["overrides"] += kept  # the export round trip below reads its checkpoint
    return run_named_worlds({1: one, 2: two, 4: four})


@pytest.mark.parametrize("name", list(EP2))
def test_ep2_reproduces_one_process(runs, name):
    """Losses and gradient norms within 1e-5 relative, every parameter (experts gathered over
    ep) within 1e-5 after the AdamW steps, the same expert loads, on both ranks."""
    one = runs[1][EP2[name][0]][0]
    assert one["losses"][-1] < one["losses"][0]
    assert_reproduces(name, runs[2][name], one)
    for two in runs[2][name]:
        loads = [r["moe_load_max_mean"] for r in two["records"]]
        assert loads == [r["moe_load_max_mean"] for r in one["records"]]
        assert two["records"][-1]["comm_bytes"]["ep"] > 0


@pytest.mark.parametrize("name", list(EP4))
def test_ep4_reproduces_one_process(runs, name):
    """ep 4 on 4 ranks, one expert each (dp 4 shares the dense weights): losses and gradient
    norms within 1e-5 relative, every parameter within 1e-5, the same expert loads."""
    one = runs[1][EP4[name][0]][0]
    assert len(runs[4][name]) == 4
    assert_reproduces(name, runs[4][name], one)
    for rank in runs[4][name]:
        loads = [r["moe_load_max_mean"] for r in rank["records"]]
        assert loads == [r["moe_load_max_mean"] for r in one["records"]]
        assert rank["records"][-1]["comm_bytes"]["ep"] > 0


@pytest.mark.parametrize("name", list(EP2))
def test_explain_prices_the_checkpoint_at_ep(world, runs, name):  # noqa: F811
    """explain's model states and buffers per rank at ep 2 equal the engine's (the experts'
    rows at 1/ep, ZeRO over dp / ep; under ZeRO-3 a root's expert unit freed once its gradients
    are launched), and its ep calls per step the measured ones (5 per MoE layer and
    micro-batch whatever the routing); its ep bytes are the balanced-routing formula's."""
    ckpt, extra = EP2[name]
    cfg = load_config(None, _lm(world, ckpt, *STEPS, *extra))
    pred = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))
    for rank in runs[2][name]:
        got = rank["records"][-1]
        for key in ("params", "grads", "master", "optimizer", "buffers"):
            assert pred["mem_bytes"][key] == got["mem_bytes"][key], (key, pred, got)
        assert [r["comm_calls"]["ep"] for r in rank["records"]] == [pred["comm_calls"]["ep"]] * len(
            rank["records"]
        )
    assert pred["comm_bytes"]["ep"] > 0


def test_a_checkpoint_without_experts_is_refused(world, tmp_path):  # noqa: F811
    """ep on a checkpoint whose config has no routed experts (a dense Llama) stops before
    launch, naming the key and the fix."""
    import shutil

    import transformers

    dense = tmp_path / "llama"
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(dense)
    for f in world["dirs"]["mixtral"].iterdir():  # its tokenizer
        if "token" in f.name:
            shutil.copy(f, dense / f.name)
    args = [a for a in _lm(world, "mixtral", "--parallel.ep=2") if "init_from" not in a]
    cfg = load_config(None, [*args, f"--model.init_from={dense}"])
    with pytest.raises(ConfigError, match=r"parallel.ep=2: .*without routed experts.*Fix:"):
        derive(cfg, 2)


def test_an_ep2_fine_tune_exports_to_what_transformers_loads(world, runs, tmp_path):  # noqa: F811
    """Load a Mixtral checkpoint, fine-tune it at ep 2 for 4 steps, export it to Hugging Face
    format: transformers' from_pretrained loads it, and its logits equal our model's with the
    run's trained parameters (experts gathered from both ranks) within 1e-5 (fp32: the same
    values through the same kernels)."""
    import torch
    import transformers

    from shardwise.cli.main import main
    from shardwise.models.init import restore_buffers
    from test_hf_moe import IDS, _ours

    out = tmp_path / "mixtral"
    assert main(["export", str(world["root"] / "run_ep2"), "--format", "hf", str(out)]) == 0
    ours, _ = _ours(world, "mixtral")
    params = runs[2]["mixtral_ep2"][0]["params"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(params[n])
        restore_buffers(ours)
        diff = (ours(IDS).logits - theirs(IDS).logits).abs().max().item()
        moved = (ours(IDS).logits - _ours(world, "mixtral")[0](IDS).logits).abs().max().item()
    assert diff <= 1e-5, diff
    assert moved > 1e-4, moved  # the fine-tune changed the model: the check is not vacuous
