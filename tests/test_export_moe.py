"""`shardwise export --format hf` of the built-in MoE decoder (models/moe.py) as transformers'
Qwen2-MoE (softmax router: models/hf/qwen2_moe.py) and GLM-4-MoE (sigmoid router:
models/hf/glm4_moe.py): moe-tiny at 2 blocks (4 experts, top-2), trained 3 steps.

Checked: from_pretrained of the export gives our model's logits (one process, all blocks MoE;
ep 2 on 2 ranks under ZeRO-3 with every 2nd block MoE, so dense blocks and experts gathered from
their ep slices); a run of the export as transformers' class (`model.name=hf`) continues with
the losses of our model from the same weights; a LoRA run (pairs on the experts) exports with
its adapters merged; a capacity run exports the dropless layer, with a note; the sigmoid router
with a shared expert and a moved balancing bias exports as GLM-4-MoE (the bias as its
`e_score_correction_bias`; without it the logits differ), which shardwise's intake reads back
with its bias (tests/test_hf_buffers.py); what no class computes (a moved bias with softmax,
shared experts with softmax, a sigmoid run with dense blocks after MoE ones) is refused with the
setting and the fix, nothing written."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.cli.main import main  # noqa: E402
from shardwise.config import load_config  # noqa: E402
from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.finetune.lora import apply_lora  # noqa: E402
from shardwise.launchers.harness import run_named, run_named_worlds  # noqa: E402
from shardwise.models.families import family_of  # noqa: E402
from shardwise.models.hf import glm4_moe  # noqa: E402
from shardwise.models.moe import MoEDecoder, moe_layers  # noqa: E402
from shardwise.models.spec import spec_from_config  # noqa: E402
from support.compare import SMALL, VOCAB, case, max_rel  # noqa: E402

MOE = ["--model.name=moe-tiny", "--train.steps=3", "--checkpoint.every=3"]
IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
# adapters on the experts and two attention projections; lr 1e-2 moves them within 3 steps
LORA = ["--finetune.lora_rank=4", "--finetune.lora_alpha=8", "--train.lr=1e-2"]
LORA += ["--finetune.lora_targets=experts,wq,wv"]
TRAINED: dict[str, torch.Tensor] = {}  # the weights `start_from_trained` gives a run
# the sigmoid router with a shared expert; the bias moved by 0.01 a step (3 steps)
GLM = ["--model.router=sigmoid", "--model.n_shared_experts=1", "--train.moe_bias_balance=0.01"]
BUFFERS = {"hook": "support.hooks:return_buffers"}  # the run's expert_bias values


def _case(root, name: str, *extra: str, **more) -> dict:
    return case(*MOE, f"--run.dir={root / name}", *extra, **more)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moexp")
    world1 = {
        "plain": _case(root, "plain", "--parallel.zero=0"),
        "biased": _case(root, "biased", "--train.moe_bias_balance=0.01"),
        "capacity": _case(root, "capacity", "--model.capacity_factor=1.0"),
        "lora": _case(root, "lora", *LORA),
        "glm": _case(root, "glm", *GLM, **BUFFERS),
    }
    ep = ["--model.moe_every=2", "--parallel.ep=2", "--parallel.zero=3"]
    world2 = {
        "ep2": _case(root, "ep2", *ep),
        "glm-ep2": _case(root, "glm-ep2", *ep, *GLM, **BUFFERS),
    }
    out = run_named_worlds({1: world1, 2: world2})
    return {"root": root, **out[1], **out[2]}


def _ours(name: str, params: dict, *extra: str, buffers: dict | None = None) -> MoEDecoder:
    """Our MoE decoder of case `name`'s shape holding `params` (and the balancing biases of
    `buffers`), for evaluation."""
    cfg = load_config(None, _case_overrides(name, *extra))
    model = MoEDecoder(spec_from_config(cfg))
    if cfg.finetune.lora_rank:
        apply_lora(model, cfg.finetune)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
        for n, b in model.named_buffers():
            if buffers and n.endswith(".expert_bias"):
                b.copy_(buffers[n])
    return model.eval()


def _case_overrides(name: str, *extra: str) -> list[str]:
    shape = {
        "ep2": ["--model.moe_every=2"],
        "capacity": ["--model.capacity_factor=1.0"],
        "lora": LORA,
        "glm": GLM,
        "glm-ep2": ["--model.moe_every=2", *GLM],
    }
    return [*SMALL, *MOE, *shape.get(name, []), *extra]


def _load(runs, name: str, capsys, arch: str = "Qwen2MoeForCausalLM"):
    """`export --format hf` of run `name` (as transformers' class `arch`): from_pretrained of it,
    and stderr."""
    out = runs["root"] / f"{name}-hf"
    assert main(["export", str(runs["root"] / name), "--format", "hf", str(out)]) == 0
    err = capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["architectures"] == [arch]
    return transformers.AutoModelForCausalLM.from_pretrained(out).eval(), err


def _export(runs, name: str, capsys) -> tuple[torch.Tensor, str]:
    """`export --format hf` of run `name`: from_pretrained's logits on IDS, and stderr."""
    theirs, err = _load(runs, name, capsys)
    with torch.no_grad():
        return theirs(IDS).logits, err


@pytest.mark.parametrize("name", ["plain", "ep2"])
def test_the_export_gives_our_logits_in_transformers(runs, name, capsys):
    """fp32, within 1e-5 (logits of size ~1): the same products in another order, and RMSNorm
    as x·rsqrt(mean x² + eps) against torch's fused rms_norm, a few roundings apart. ep2
    writes each layer's experts from the two ranks' slices, and block 0 stays dense."""
    theirs, _ = _export(runs, name, capsys)
    with torch.no_grad():
        ours = _ours(name, runs[name][0]["params"])(IDS)
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-5, diff
    assert ours.abs().max() > 0.1  # logits of a trained model, not zeros
    if name == "ep2":
        dense = runs["ep2"][0]["params"]["blocks.0.mlp.w1.weight"]
        assert dense.dim() == 2  # block 0 is dense (decoder_sparse_step=2 in the export)


def test_a_lora_run_exports_with_its_adapters_merged(runs, capsys):
    """LoRA on the experts (a pair per expert) and on wq/wv: the export holds W + (alpha/r)·B·A
    in every stacked expert weight and projection; transformers' logits equal our adapted
    model's within 1e-5 (the merge reorders each adapted product's fp32 sums), and the
    adapters moved them (> 1e-4 from the same model with B = 0)."""
    theirs, _ = _export(runs, "lora", capsys)
    model = _ours("lora", runs["lora"][0]["params"])
    with torch.no_grad():
        adapted = model(IDS)
        for n, p in model.named_parameters():
            if ".lora_B" in n:
                p.zero_()
        plain = model(IDS)
    diff = (adapted - theirs).abs().max().item()
    assert diff <= 1e-5, diff
    assert (adapted - plain).abs().max() > 1e-4


def start_from_trained(run) -> None:
    """Hook: the run's parameters start from `TRAINED` (its optimizer is fresh)."""
    with torch.no_grad():
        for n, p in run.model.named_parameters():
            p.copy_(TRAINED[n])


def test_the_export_continues_as_transformers_class_with_our_losses(runs, capsys):
    """The export trained as transformers' Qwen2-MoE (`model.name=hf`, our intake of a Hugging
    Face checkpoint) and our MoE decoder from the same weights, on the same data: two AdamW
    steps give the same losses within 1e-6 relative (fp32 roundings). The 0-wide shared expert
    and its gate add nothing and get zero gradients, so the steps agree too."""
    _export(runs, "plain", capsys)
    TRAINED.clear()
    TRAINED.update(runs["plain"][0]["params"])
    data = [o for o in SMALL if not o.startswith("--model.")]
    common = [*data, "--train.steps=2", "--optim.warmup_steps=1", "--data.tokenizer=bpe"]
    common += ["--parallel.zero=0"]
    hf = ["--model.name=hf", f"--model.init_from={runs['root'] / 'plain-hf'}", *common]
    ours = [*SMALL, "--model.name=moe-tiny", *common]
    out = run_named(
        1,
        {
            "hf": {"overrides": hf},
            "ours": {"overrides": ours, "hook": "test_export_moe:start_from_trained"},
        },
    )
    got, want = out["hf"][0]["losses"], out["ours"][0]["losses"]
    assert len(got) == 2 and max_rel(got, want) <= 1e-6, (got, want)
    assert any(".mlp.experts.gate_up_proj" in k for k in out["hf"][0]["params"])


def test_a_capacity_run_exports_the_dropless_layer_with_a_note(runs, capsys):
    """transformers' class is dropless: the export equals our layer with the trained weights
    and no capacity (within 1e-5), and ours with a capacity that cannot overflow (2.0: C = S
    slots, no expert can get more than S tokens of a sequence); the note says so. With the
    run's own 1.0 our layer drops tokens of these sequences, and there the two differ."""
    theirs, err = _export(runs, "capacity", capsys)
    assert "note: model.capacity_factor=1.0: the exported Qwen2-MoE is dropless" in err, err
    params = runs["capacity"][0]["params"]
    trained = _ours("capacity", params)
    with torch.no_grad():
        diff = (trained(IDS) - theirs).abs().max().item()
    assert sum(layer.last[layer.n_experts].item() for layer in moe_layers(trained)) > 0
    assert diff > 1e-3, diff
    for factor in ("0", "2.0"):
        model = _ours("capacity", params, f"--model.capacity_factor={factor}")
        with torch.no_grad():
            diff = (model(IDS) - theirs).abs().max().item()
        dropped = sum(layer.last[layer.n_experts].item() for layer in moe_layers(model))
        assert diff <= 1e-5 and dropped == 0, (factor, diff, dropped)


@pytest.mark.parametrize("name", ["glm", "glm-ep2"])
def test_the_sigmoid_router_exports_as_glm4_moe_with_its_bias(runs, name, capsys):
    """The sigmoid router, a shared expert and a balancing bias that 3 steps moved: the export
    is GLM-4-MoE with each layer's bias as its e_score_correction_bias (fp32, bit for bit), and
    from_pretrained gives our logits within 1e-5 in fp32 (as the Qwen2-MoE export: the same
    products in another order, RMSNorm unfused). The bias matters: with transformers' biases
    zeroed the logits move by more than 1e-4. glm-ep2: 2 ranks, ep 2 under ZeRO-3, block 0
    dense (first_k_dense_replace=1)."""
    theirs, _ = _load(runs, name, capsys, "Glm4MoeForCausalLM")
    params, buffers = runs[name][0]["params"], runs[name][0]["buffers"]
    ours = _ours(name, params, buffers=buffers)
    layers = [i for i, block in enumerate(ours.blocks) if hasattr(block.mlp, "expert_bias")]
    assert layers == ([1] if name == "glm-ep2" else [0, 1])
    assert theirs.config.first_k_dense_replace == layers[0]
    for i in layers:
        bias = buffers[glm4_moe.bias_name(i)]
        assert bias.abs().max() > 0, i  # moved by train.moe_bias_balance
        held = theirs.model.layers[i].mlp.gate.e_score_correction_bias
        assert held.dtype == torch.float32 and torch.equal(held, bias), i
    with torch.no_grad():
        want = ours(IDS)
        diff = (want - theirs(IDS).logits).abs().max().item()
        for i in layers:
            theirs.model.layers[i].mlp.gate.e_score_correction_bias.zero_()
        unbiased = (want - theirs(IDS).logits).abs().max().item()
    assert diff <= 1e-5, diff
    assert want.abs().max() > 0.1
    assert unbiased > 1e-4, unbiased


def test_what_no_class_computes_is_refused(runs, capsys):
    """A balancing bias the run moved with the softmax router (Qwen2-MoE has no such term, and
    GLM-4-MoE routes by sigmoid), shared experts with softmax, and the sigmoid router with MoE
    blocks before dense ones: one line each naming the setting and the fix; nothing written.
    A GLM-4-MoE export without the run's biases is refused too."""
    out = runs["root"] / "biased-hf"
    assert main(["export", str(runs["root"] / "biased"), "--format", "hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: blocks.0.mlp.expert_bias is not zero"), err
    assert "Fix: train with --train.moe_bias_balance=0" in err and "Traceback" not in err
    assert not out.exists()
    spec = spec_from_config(load_config(None, _case_overrides("plain")))
    check = family_of(spec).hf_check
    sigmoid = dataclasses.replace(spec, router="sigmoid")
    biases = {glm4_moe.bias_name(i): torch.zeros(spec.n_experts) for i in range(3)}
    refused = [
        (
            dataclasses.replace(spec, n_shared_experts=1),
            "^model.n_shared_experts=1: .*Fix: train with --model.n_shared_experts=0, or with "
            "--model.router=sigmoid",
        ),
        (
            dataclasses.replace(sigmoid, n_layers=3, moe_every=2),
            r"^model.moe_every=2 with model.n_layers=3 makes blocks \[1\] MoE.*Fix: train with "
            "--model.moe_every=1",
        ),
        (sigmoid, r"^the checkpoint holds no blocks.0.mlp.expert_bias.*Fix: "),
    ]
    for bad, pattern in refused:
        with pytest.raises(ShardwiseError, match=pattern):
            check(bad, biases if bad.n_layers == 3 else {})
    assert check(sigmoid, biases) == []  # with its biases, the sigmoid router exports
