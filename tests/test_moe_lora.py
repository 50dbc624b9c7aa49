"""LoRA on routed experts (models/expert_lora.py): a low-rank pair per expert on the stacked
expert weights of the built-in MoE decoder (moe-tiny at 2 blocks) and of transformers' Mixtral
(the tiny checkpoint of tests/test_hf_moe.py), beside adapters on attention projections.

fp32, dropless. One 4-rank world runs every multi-rank case (ep 2 x dp 2 under ZeRO-0 and
ZeRO-3), one process the references: the same losses, gradient norms, first-step gradients
and final parameters within 1e-5; the frozen base never written; the adapters move the
model; explain's model states per rank exact; the ep 2 checkpoint resumes on one process;
the merged export loads in transformers with the adapted model's logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from shardwise.config import load_config  # noqa: E402
from shardwise.errors import ConfigError, ShardwiseError  # noqa: E402
from shardwise.finetune.lora import apply_lora  # noqa: E402
from shardwise.job.explain import explain_record  # noqa: E402
from shardwise.launchers.harness import run_named_worlds  # noqa: E402
from shardwise.models import build_model, to_empty  # noqa: E402
from shardwise.models.init import canonical_name, restore_buffers  # noqa: E402
from shardwise.plan.hardware import get_hardware  # noqa: E402
from shardwise.training.validate import derive  # noqa: E402
from support.compare import case, max_param_diff, max_rel  # noqa: E402
from test_hf_moe import COMMON, IDS, STEPS, _lm, world  # noqa: E402, F401 (the checkpoints' fixture)
from test_lora import _initial  # noqa: E402 (the parameters a LoRA run starts from)

pytestmark = pytest.mark.slow

MOE = ["--model.name=moe-tiny", "--train.steps=4", "--optim.warmup_steps=1"]
PAIR = ["--finetune.lora_rank=4", "--finetune.lora_alpha=8"]
LORA = [*PAIR, "--finetune.lora_targets=experts,wq,wv"]
MIX_LORA = [*PAIR, "--finetune.lora_targets=experts,q_proj,v_proj"]
EP2 = ["--parallel.ep=2"]  # on 4 ranks: ep 2 x dp 2
Z3 = ["--parallel.zero=3"]
GRADS = {"peer": "support.ep_peers:first_grads"}  # one step's reduced gradients, full shape
HALF = "step-00000002"


def _moe(*extra: str, **more) -> dict:
    return case(*MOE, *extra, **more)


def _mix(world, *extra: str, ckpt: str = "mixtral", **more) -> dict:  # noqa: F811
    return {"overrides": _lm(world, ckpt, *STEPS, *MIX_LORA, *extra), **more}


@pytest.fixture(scope="module")
def runs(world):  # noqa: F811
    root = world["root"] / "moe_lora"
    saves = ["--checkpoint.every=2", f"--checkpoint.dir={root / 'moe_ep2'}"]
    one = {
        "moe": _moe(*LORA),
        "moe_base": _moe(),  # no adapters: every parameter trains
        "moe_attn": _moe(*PAIR, "--finetune.lora_targets=wq,wv"),  # no expert adapters
        "moe_grads": _moe(*LORA, "--train.steps=1", **GRADS),
        "mix": _mix(world),
        "mix_grads": _mix(world, "--train.steps=1", **GRADS),
        "qwen": _mix(world, ckpt="qwen2_moe"),  # its shared expert stays a plain linear
    }
    four = {
        "moe_ep2": _moe(*LORA, *EP2, *saves),
        "moe_ep2_z3": _moe(*LORA, *EP2, *Z3),
        "moe_grads_ep2": _moe(*LORA, *EP2, "--train.steps=1", **GRADS),
        "mix_ep2": _mix(world, *EP2, "--checkpoint.every=4", f"--run.dir={root / 'mix_ep2'}"),
        "mix_ep2_z3": _mix(world, *EP2, *Z3),
        "mix_grads_ep2": _mix(world, *EP2, "--train.steps=1", **GRADS),
        "qwen_ep2": _mix(world, *EP2, ckpt="qwen2_moe"),
    }
    out = {n: r for w in run_named_worlds({1: one, 4: four}).values() for n, r in w.items()}
    at = [f"--checkpoint.resume={root / 'moe_ep2' / HALF}", f"--checkpoint.dir={root / 'to1'}"]
    out.update(run_named_worlds({1: {"moe_ep2_to_1": _moe(*LORA, *at)}})[1])
    for name, ranks in out.items():
        for r in ranks:
            assert "error" not in r, (name, r["error"])
    out["root"] = root
    return out


@pytest.mark.parametrize("name", ["moe_ep2", "moe_ep2_z3", "mix_ep2", "mix_ep2_z3", "qwen_ep2"])
def test_ep2_reproduces_one_process(runs, name):
    """Losses and gradient norms within 1e-5 relative every step, every parameter (experts
    and their adapters gathered over ep) within 1e-5 after the AdamW steps, on every rank."""
    ref = runs[name.split("_")[0]][0]
    for r in runs[name]:
        assert max_rel(r["losses"], ref["losses"]) <= 1e-5, (r["losses"], ref["losses"])
        norms = [x["grad_norm"] for x in r["records"]]
        assert max_rel(norms, [x["grad_norm"] for x in ref["records"]]) <= 1e-5
        assert max_param_diff(r["params"], ref["params"]) <= 1e-5


@pytest.mark.parametrize("name", ["moe", "mix"])
def test_ep2_first_gradients_equal_one_process(runs, name):
    """Every trainable parameter's reduced gradient of the first step at ep 2 x dp 2 (expert
    adapters gathered to full shape) equals the single process's within 1e-5 of the tensor's
    largest entry, on every rank; the experts' B gradients are not zero (A's are: B starts at
    zero, so dL/dA = 0 at step 1)."""
    ref = runs[f"{name}_grads"][0]["grads"]
    b = [n for n in ref if ".lora_B." in n and (".experts." in n or ".mlp.lora_B." in n)]
    assert b and all(ref[n].abs().max() > 0 for n in b)
    for r in runs[f"{name}_grads_ep2"]:
        assert r["grads"].keys() == ref.keys()
        for n, want in ref.items():
            scale = want.abs().max().item()
            assert (r["grads"][n] - want).abs().max().item() <= 1e-5 * scale, n


def test_the_base_stays_bitwise_and_the_expert_adapters_move(runs):
    """One process and every ep 2 rank: each frozen weight (stacked experts included) equals its
    initial value bit for bit after training; every expert adapter moved (B from zero)."""
    start = _initial(_moe(*LORA)["overrides"])
    experts = [n for n in start if ".mlp.lora_" in n]
    assert len(experts) == 2 * 2 * 3  # 2 MoE layers x (A, B) x (w1, w3, w2)
    assert all(start[n].abs().max() == 0 for n in experts if ".lora_B." in n)
    for r in [runs["moe"][0], *runs["moe_ep2"], *runs["moe_ep2_z3"]]:
        end = r["params"]
        for n in start:
            if ".lora_" not in n:
                assert torch.equal(end[n], start[n]), n
        for n in experts:
            assert not torch.equal(end[n], start[n]), n


@pytest.mark.parametrize("name", ["mix", "qwen"])
def test_the_checkpoint_stays_bitwise_under_expert_adapters(world, runs, name):  # noqa: F811
    """Mixtral and Qwen2-MoE, one process and every ep 2 rank: each weight of the checkpoint
    (stacked experts included) is its value after training, bit for bit; every expert adapter
    (A, B of gate_up_proj and down_proj in each of the 2 layers) moved."""
    ckpt = world["dirs"]["mixtral" if name == "mix" else "qwen2_moe"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    start = {n: p.detach() for n, p in theirs.named_parameters()}
    for r in [runs[name][0], *runs[f"{name}_ep2"]]:
        end = {canonical_name(n): v for n, v in r["params"].items()}  # peft's base_layer out
        experts = [n for n in end if ".experts.lora_" in n]
        assert len(experts) == 2 * 2 * 2, experts
        assert all(end[n].abs().max() > 0 for n in experts)
        for n, want in start.items():
            assert torch.equal(end[n], want), n


def test_the_expert_adapters_change_the_run(runs):
    """The first loss is the base model's (B = 0: the same function as without adapters and
    as with attention adapters only); from the second step on the losses differ from both."""
    lora, base, attn = (runs[n][0]["losses"] for n in ("moe", "moe_base", "moe_attn"))
    assert abs(lora[0] - base[0]) <= 1e-6 * abs(base[0]) and lora[0] == attn[0]
    for other in (base, attn):
        assert all(abs(x - y) > 1e-5 for x, y in zip(lora[1:], other[1:], strict=True))


def test_an_ep2_checkpoint_resumes_on_one_process(runs):
    """The ep 2 x dp 2 checkpoint (adapters stored under their global names and shapes)
    resumes on one process: the next losses and final parameters are the single process's
    within 1e-5."""
    full = runs["moe"][0]
    resumed = runs["moe_ep2_to_1"][0]
    assert [r["step"] for r in resumed["records"]] == [3, 4]
    assert max_rel(resumed["losses"], full["losses"][2:]) <= 1e-5
    assert max_param_diff(resumed["params"], full["params"]) <= 1e-5


@pytest.mark.parametrize("name", ["moe_ep2", "moe_ep2_z3", "mix_ep2", "mix_ep2_z3"])
def test_explain_states_the_model_memory_per_rank_exactly(world, runs, name):  # noqa: F811
    """explain's params, grads, master and optimizer bytes per rank equal the engine's (max
    over ranks): the experts and their adapters at 1/ep, only the adapters with gradients
    and optimizer state, ZeRO over the ranks holding the same experts; its LoRA line counts
    the adapted stacked weights beside the linear layers."""
    overrides = {
        "moe_ep2": _moe(*LORA, *EP2),
        "moe_ep2_z3": _moe(*LORA, *EP2, *Z3),
        "mix_ep2": _mix(world, *EP2),
        "mix_ep2_z3": _mix(world, *EP2, *Z3),
    }[name]["overrides"]
    cfg = load_config(None, overrides)
    record = explain_record(cfg, 4, get_hardware("cpu", calibrate=False))
    pred = record["mem_bytes"]
    for key in ("params", "grads", "master", "optimizer"):
        got = max(r["records"][-1]["mem_bytes"][key] for r in runs[name])
        assert pred[key] == got, (key, pred[key], got)
    # adapted: 2 layers x 2 attention projections, 2 x 3 (ours) or 2 x 2 (Mixtral) expert weights
    assert record["lora"]["layers"] == (10 if name.startswith("moe") else 8)


def test_the_ep2_export_merges_the_expert_adapters(world, runs, tmp_path):  # noqa: F811
    """`export --format hf` of the ep 2 Mixtral run merges each expert's pair into the stacked
    weights (W + alpha/r · B·A); transformers loads it and its logits equal our adapted model's
    (adapters unmerged, the run's trained parameters) within 1e-5: the merge reorders each
    adapted product's fp32 sums. The adapters moved the logits (> 1e-4 from the checkpoint's);
    `--format peft` is refused (peft holds no per-expert pairs)."""
    from shardwise.checkpoint.export_peft import export_peft
    from shardwise.cli.main import main

    run, out = runs["root"] / "mix_ep2", tmp_path / "merged"
    assert main(["export", str(run), "--format", "hf", str(out)]) == 0
    cfg = load_config(None, _mix(world)["overrides"])
    spec = derive(cfg, 1).spec
    with torch.device("meta"):
        ours = build_model(spec)
        apply_lora(ours, cfg.finetune)
    to_empty(ours, torch.device("cpu"))
    params = runs["mix_ep2"][0]["params"]
    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(params[n])
        restore_buffers(ours)
        want = ours.eval()(IDS).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(IDS).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(world["dirs"]["mixtral"])
        plain = base.eval()(IDS).logits
    assert (want - plain).abs().max() > 1e-4
    diff = (merged - want).abs().max().item()
    assert diff <= 1e-5, diff
    with pytest.raises(ShardwiseError, match=r"stacked expert weights.*Fix: --format hf"):
        export_peft(run, tmp_path / "peft")


def _fill(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize(("capacity", "rank"), [(0.0, 4), (1.0, 4), (0.0, 3)])
def test_the_pairs_compute_the_merged_weights_of_our_moe(capacity, rank):
    """An MoE layer with a pair on w1, w3 and w2 (B not zero) gives the outputs of the layer
    whose weights are W + alpha/r·(B·A)ᵀ per expert ([E, in, out]), dropless and with a
    capacity (the batched-matmul path), within 1e-5 of the largest output (fp32: other
    orders of the sums), and away from the layer without them. Rank 3 (12-byte rows, which
    the grouped kernel refuses) runs padded with zeros."""
    from shardwise.models.expert_lora import merged_delta
    from shardwise.models.moe import MoE
    from shardwise.models.presets import preset

    spec = preset("moe-tiny", capacity_factor=capacity)
    layer, merged, plain = MoE(spec), MoE(spec), MoE(spec)
    _fill(layer, 0)
    merged.load_state_dict(layer.state_dict())
    plain.load_state_dict(layer.state_dict())
    targets = [f"--finetune.lora_rank={rank}", "--finetune.lora_targets=experts"]
    apply_lora(layer, load_config(None, [*PAIR, *targets]).finetune)
    _fill(layer.lora_A, 1)
    _fill(layer.lora_B, 2)
    with torch.no_grad():
        for leaf in ("w1", "w3", "w2"):
            a, b = layer.lora_A[leaf], layer.lora_B[leaf]
            getattr(merged, leaf).add_(merged_delta(a, b, 8 / rank, in_out=True))
        x = torch.randn(2, 16, spec.dim, generator=torch.Generator().manual_seed(3))
        got, want = layer(x), merged(x)
        assert (got - plain(x)).abs().max() > 1e-3  # the pairs are applied
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_the_pairs_compute_the_merged_weights_of_mixtral():
    """transformers' Mixtral ([E, out, in] stacked experts, our expert forward): adapters on
    gate_up_proj and down_proj give the logits of the model with W + alpha/r·B·A per expert
    within 1e-5, and logits > 1e-3 from the base's (the pairs are applied)."""
    import copy

    from shardwise.models.expert_lora import merged_delta
    from shardwise.models.hf.experts import experts_modules, use_shardwise_experts

    config = transformers.MixtralConfig(vocab_size=64, num_local_experts=4, **COMMON)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    use_shardwise_experts(model)
    merged = copy.deepcopy(model)
    with torch.no_grad():
        base = model(IDS % 64).logits
    apply_lora(model, load_config(None, [*PAIR, "--finetune.lora_targets=experts"]).finetune)
    with torch.no_grad():
        for ours, theirs in zip(experts_modules(model), experts_modules(merged), strict=True):
            _fill(ours.lora_A, 1)
            _fill(ours.lora_B, 2)
            for leaf in ("gate_up_proj", "down_proj"):
                a, b = ours.lora_A[leaf], ours.lora_B[leaf]
                getattr(theirs, leaf).add_(merged_delta(a, b, 2.0, in_out=False))
        got, want = model(IDS % 64).logits, merged(IDS % 64).logits
    assert (got - base).abs().max() > 1e-3
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize(
    ("extra", "size", "message"),
    [
        (["--parallel.tp=2", "--parallel.sp=true"], 2, r"adapts stacked expert.*parallel.tp=2"),
        (["--parallel.pp=2", "--train.micro_batch=2"], 2, r"adapts stacked expert.*Fix:"),
        (["--finetune.lora_dropout=0.1"], 1, r"lora_dropout=0.1 with adapters on experts.*Fix:"),
    ],
)
def test_what_is_not_built_is_refused(extra, size, message):
    """Expert adapters with tp or pp (not checked yet), or with dropout (a token's rows are
    permuted among experts), stop before launch naming the value and the fix."""
    with pytest.raises(ConfigError, match=message):
        derive(load_config(None, _moe(*LORA, *extra)["overrides"]), size)


def test_a_quantised_base_with_only_expert_adapters_names_the_real_problem():
    """base_quant quantises adapted linear layers; adapters on the experts alone leave none
    (the experts stay in compute dtype): refused before launch, naming that and both fixes;
    the experts with attention linears beside them pass."""
    pytest.importorskip("bitsandbytes")
    from shardwise.finetune import build_adapted

    quant = ["--finetune.base_quant=nf4"]
    only = _moe(*PAIR, "--finetune.lora_targets=experts", *quant)["overrides"]
    with pytest.raises(ConfigError) as err:
        derive(load_config(None, only), 1)
    text = str(err.value)
    assert "finetune.lora_targets='experts' adapts stacked expert weights only" in text, text
    assert "stay in the compute dtype" in text and "lora_rank=16" not in text, text
    assert "--finetune.lora_targets=experts,wq,wv" in text, text
    assert "--finetune.base_quant=none" in text, text
    both = load_config(None, _moe(*LORA, *quant)["overrides"])
    assert build_adapted(derive(both, 1).spec, both.finetune)[1]  # wq and wv quantised


def _adapted(overrides: list[str]) -> set[str]:
    from shardwise.finetune import build_adapted
    from shardwise.models.expert_lora import adapted_weights

    cfg = load_config(None, overrides)
    return set(adapted_weights(build_adapted(derive(cfg, 1).spec, cfg.finetune)[0]))


def test_targets_name_experts_by_keyword_weight_or_path(world):  # noqa: F811
    """`experts` names every stacked weight, a weight's name or path pattern that weight, a
    transformers experts module's path all of its weights; `all-linear` none of them."""
    moe = {f"blocks.{i}.mlp.{w}" for i in (0, 1) for w in ("w1", "w3", "w2")}

    def ours(targets: str) -> set[str]:
        return _adapted(_moe(*PAIR, f"--finetune.lora_targets={targets}")["overrides"])

    assert ours("experts") == moe
    assert ours("w2,wq") == {"blocks.0.mlp.w2", "blocks.1.mlp.w2"}
    assert ours("blocks.1.mlp.w1") == {"blocks.1.mlp.w1"}
    assert ours("all-linear") == set()

    def mixtral(targets: str) -> set[str]:
        return _adapted(_lm(world, "mixtral", *PAIR, f"--finetune.lora_targets={targets}"))

    stacked = {"gate_up_proj", "down_proj"}
    layer = "model.layers.{}.mlp.experts.{}"
    assert mixtral("experts") == {layer.format(i, w) for i in (0, 1) for w in stacked}
    assert mixtral("down_proj") == {layer.format(i, "down_proj") for i in (0, 1)}
    assert mixtral("model.layers.0.mlp.experts") == {layer.format(0, w) for w in stacked}


def test_an_unknown_target_names_the_experts_pattern():
    """A pattern matching neither a linear layer nor an expert weight is refused, and the fix
    lists `experts` beside the linear layers."""
    with pytest.raises(ConfigError, match=r"'w9' matches no linear layer.*experts \(stacked"):
        derive(load_config(None, _moe(*PAIR, "--finetune.lora_targets=w9")["overrides"]), 1)
