"""Hugging Face mixture-of-experts checkpoints as transformers' own classes (`model.name=hf`):
Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, tiny configs (2 layers, 4 experts, top-2) with random
weights saved by save_pretrained beside a tokenizer trained here.

save_pretrained writes one tensor per expert (`experts.N.w1`, ...) while the classes hold each
layer's experts as one stacked parameter; shardwise reads a stacked parameter's rows (experts)
straight from those tensors, as transformers' loader merges them. Checked: the logits equal
`from_pretrained`'s, dp2 ZeRO-0 and ZeRO-3 reproduce one process (losses, parameters and expert
loads), ZeRO-3 units are the decoder layers with their experts, explain counts them exactly,
LoRA on the attention projections, the export reloads in transformers with our logits, and
what is not built (tp, the zero-bubble schedule, shardwise's balance keys) is refused; LoRA on
the experts is tests/test_moe_lora.py's, pipeline stages tests/test_hf_moe_parallel.py's."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.config import load_config  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.job.explain import explain_record  # noqa: E402
from shardwise.launchers.harness import run_named_worlds  # noqa: E402
from shardwise.models import build_model, to_empty  # noqa: E402
from shardwise.models.hf.auto import weight_source  # noqa: E402
from shardwise.models.hf.weights import load_weights  # noqa: E402
from shardwise.models.init import restore_buffers  # noqa: E402
from shardwise.parallel.zero_units import unit_roots  # noqa: E402
from shardwise.plan.hardware import get_hardware  # noqa: E402
from shardwise.training.validate import derive  # noqa: E402
from support.compare import max_param_diff, max_rel  # noqa: E402
from test_pretrained_tokenizer import _documents, _tokenizer  # noqa: E402

COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    num_experts_per_tok=2,
)
MOE = {
    "mixtral": lambda v: transformers.MixtralConfig(vocab_size=v, num_local_experts=4, **COMMON),
    "qwen2_moe": lambda v: transformers.Qwen2MoeConfig(
        vocab_size=v,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        **COMMON,
    ),
    "qwen3_moe": lambda v: transformers.Qwen3MoeConfig(
        vocab_size=v, num_experts=4, moe_intermediate_size=16, head_dim=8, **COMMON
    ),
    "olmoe": lambda v: transformers.OlmoeConfig(vocab_size=v, num_experts=4, **COMMON),
}
TRAINED = ["mixtral", "qwen2_moe", "olmoe"]  # through every layout (Qwen3-MoE: ZeRO-3 only)
STEPS = ["--train.steps=4", "--train.lr=1e-3", "--optim.warmup_steps=1", "--optim.eps=1e-6"]
ATTN = "--finetune.lora_targets=q_proj,k_proj,v_proj,o_proj"
LORA = ["--finetune.lora_rank=4", "--finetune.lora_alpha=8", ATTN]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfmoe")
    docs = _documents()
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = _tokenizer(320, docs)
    dirs = {}
    for name, make in MOE.items():
        dirs[name] = out = root / name
        tok.save_pretrained(out)
        config = make(len(tok))
        # the tokenizer's special ids (OLMoE's defaults name ids past this vocabulary)
        config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, None
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return {"root": root, "data": data, "dirs": dirs, "cache": root / "cache"}


def _lm(world, name: str, *extra: str) -> list[str]:
    return [
        "--model.name=hf",
        f"--model.init_from={world['dirs'][name]}",
        f"--data.dataset={world['data']}",
        "--data.seq_len=32",
        "--data.val_fraction=0.1",
        f"--data.cache_dir={world['cache']}",
        "--train.global_batch=8",
        "--train.eval_every=0",
        "--train.eval_batches=0",
        *extra,
    ]


def _ours(world, name: str, *extra: str):
    """Our model of checkpoint `name` on CPU with the checkpoint's values, and its spec."""
    spec = derive(load_config(None, _lm(world, name, *extra)), 1).spec
    with torch.device("meta"):
        model = build_model(spec)
    to_empty(model, torch.device("cpu"))
    load_weights(model, weight_source(spec, model))
    return model.eval(), spec


IDS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(MOE))
def test_logits_equal_transformers(world, name):
    """The stacked experts read from one tensor per expert ([gate; up] concatenated as the
    loader does) and computed by shardwise's expert matmul give from_pretrained's logits (both
    take the same grouped kernel on CPU fp32: measured 0.0)."""
    ours, _ = _ours(world, name)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(world["dirs"][name]).eval()
    with torch.no_grad():
        diff = (ours(IDS).logits - theirs(IDS).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_a_zero_slice_of_stacked_experts_reads_only_its_experts(world):
    """A ZeRO-3 rank's slice of a stacked parameter (elements across an expert boundary) equals
    that slice of the merged tensor, and reads only the experts it lies in."""
    spec = derive(load_config(None, _lm(world, "mixtral")), 1).spec
    with torch.device("meta"):
        model = build_model(spec)
    source = weight_source(spec, model)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(world["dirs"]["mixtral"])
    name = "model.layers.1.mlp.experts.gate_up_proj"
    full = dict(theirs.named_parameters())[name].detach()
    per_expert = full[0].numel()
    start, stop = per_expert - 100, per_expert + 50  # the end of expert 0, the start of 1
    before = source.elements_read
    got = source.span(name, tuple(full.shape), start, stop)
    assert torch.equal(got, full.flatten()[start:stop])
    assert source.elements_read - before == 2 * per_expert  # experts 0 and 1, not all four


@pytest.fixture(scope="module")
def runs(world):
    root = world["root"]
    keep = ["--checkpoint.every=4"]
    worlds: dict[int, dict] = {1: {}, 2: {}}
    for name in TRAINED:
        worlds[1][name] = {"overrides": _lm(world, name, *STEPS)}
        worlds[2][f"{name}_z0"] = {"overrides": _lm(world, name, *STEPS, "--parallel.zero=0")}
        worlds[2][f"{name}_z3"] = {"overrides": _lm(world, name, *STEPS, "--parallel.zero=3")}
    worlds[1]["qwen3_moe"] = {"overrides": _lm(world, "qwen3_moe", *STEPS)}
    worlds[2]["qwen3_moe_z3"] = {"overrides": _lm(world, "qwen3_moe", *STEPS, "--parallel.zero=3")}
    z3_run = f"--run.dir={root / 'run_z3'}"
    worlds[2]["olmoe_z3_kept"] = {
        "overrides": _lm(world, "olmoe", *STEPS, "--parallel.zero=3", *keep, z3_run)
    }
    worlds[1]["mixtral_lora"] = {"overrides": _lm(world, "mixtral", *STEPS, *LORA)}
    lora_run = f"--run.dir={root / 'run_lora'}"
    worlds[2]["mixtral_lora_z3"] = {
        "overrides": _lm(world, "mixtral", *STEPS, *LORA, "--parallel.zero=3", *keep, lora_run)
    }
    out = run_named_worlds(worlds)
    for cases in out.values():
        for case, ranks in cases.items():
            assert "error" not in ranks[0], (case, ranks[0].get("error"))
    return out


@pytest.mark.parametrize("name", [*TRAINED, "qwen3_moe"])
def test_dp2_zero0_and_zero3_reproduce_one_process(runs, name):
    """fp32: the losses within 1e-5 relative and the parameters (experts and routers included)
    within 1e-5; each rank routes its own tokens, so only the sums of the two ranks' products
    differ from one process's, in the last bits. The per-layer expert loads are counts summed
    over every micro-batch and rank, so they are the same numbers in every layout."""
    one = runs[1][name][0]
    layouts = ["z3"] if name == "qwen3_moe" else ["z0", "z3"]
    for layout in layouts:
        two = runs[2][f"{name}_{layout}"][0]
        assert max_rel(two["losses"], one["losses"]) <= 1e-5, (layout, two["losses"])
        assert max_param_diff(two["params"], one["params"]) <= 1e-5, layout
        loads = [r["moe_load_max_mean"] for r in two["records"]]
        assert loads == [r["moe_load_max_mean"] for r in one["records"]], layout
    assert any(".experts.gate_up_proj" in k for k in one["params"])
    assert one["losses"][-1] < one["losses"][0]


def test_expert_loads_are_reported_per_layer(runs):
    """metrics.jsonl gets `moe_load_max_mean` per MoE layer (busiest expert's top-k count over
    the mean, from the routers' choices: >= 1, at most E / k = 2 when every token picks the same
    two), as shardwise's own MoE reports it; no `moe_aux_loss` or `moe_dropped`: shardwise adds
    no balance loss to these routers and their experts are dropless."""
    for record in runs[1]["mixtral"][0]["records"]:
        loads = record["moe_load_max_mean"]
        assert len(loads) == 2 and all(1.0 <= v <= 2.0 for v in loads), loads
        assert "moe_aux_loss" not in record and "moe_dropped" not in record


def test_zero3_units_are_decoder_layers_holding_their_experts(world):
    """ZeRO-3 cuts the model at `_no_split_modules` (MixtralDecoderLayer, ...): one unit per
    decoder layer, and the layer's stacked experts, router and shared expert are in it, so a
    layer's experts are gathered once per use, together with its attention."""
    for name in MOE:
        model, _ = _ours(world, name)
        units = {root: [e[0] for e in entries] for root, entries, _ in unit_roots(model)}
        layers = [root for root in units if ".layers." in root]
        assert layers == ["model.layers.0", "model.layers.1"], (name, list(units))
        for root in layers:
            assert f"{root}.mlp.experts.gate_up_proj" in units[root], name
            assert f"{root}.mlp.experts.down_proj" in units[root], name
            assert f"{root}.mlp.gate.weight" in units[root], name


STATES = ("params", "grads", "master", "optimizer")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_explain_counts_the_real_units(world, runs, name):
    """explain on the checkpoint's model (its fake forward runs the stacked experts, split
    evenly) predicts the dp2 ZeRO-3 run's model states exactly: it counts the real model's
    units, experts included."""
    cfg = load_config(None, _lm(world, name, *STEPS, "--parallel.zero=3"))
    pred = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))["mem_bytes"]
    got = runs[2][f"{name}_z3"][0]["records"][-1]["mem_bytes"]
    for key in STATES:
        assert pred[key] == got[key], (key, pred[key], got[key])


def test_lora_on_the_attention_reproduces_one_process(runs):
    """LoRA on q/k/v/o of Mixtral: only the adapters train (the experts stay the checkpoint's),
    and dp2 ZeRO-3 reproduces one process to 1e-5."""
    one, z3 = runs[1]["mixtral_lora"][0], runs[2]["mixtral_lora_z3"][0]
    assert max_rel(z3["losses"], one["losses"]) <= 1e-5
    assert max_param_diff(z3["params"], one["params"]) <= 1e-5
    adapted = {k.split(".lora_")[0] for k in one["params"] if ".lora_" in k}
    assert {k.rsplit(".", 2)[-1] for k in adapted} == {"q_proj", "k_proj", "v_proj", "o_proj"}


def _exported_logits(out) -> torch.Tensor:
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        return theirs(IDS).logits


def test_the_export_reloads_in_transformers_with_our_logits(world, runs, tmp_path):
    """`shardwise export --format hf` of the dp2 ZeRO-3 OLMoE run writes the class's own
    (stacked) names and its config; from_pretrained loads it and its logits equal our model's
    with the trained parameters within 1e-5 (fp32: the same values, the same kernels)."""
    from shardwise.cli.main import main

    out = tmp_path / "olmoe"
    assert main(["export", str(world["root"] / "run_z3"), "--format", "hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["OlmoeForCausalLM"]
    ours, _ = _ours(world, "olmoe")
    params = runs[2]["olmoe_z3_kept"][0]["params"]
    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(params[n])
        restore_buffers(ours)
        diff = (ours(IDS).logits - _exported_logits(out)).abs().max().item()
    assert diff <= 1e-5, diff


def test_the_lora_export_merges_into_a_model_transformers_loads(world, runs, tmp_path):
    """The LoRA run's merged export loads in transformers and gives the logits of the
    checkpoint plus the trained adapters (peft over from_pretrained, unmerged) within 1e-5:
    merging reorders each adapted product's sums, a few fp32 roundings of logits of size ~1."""
    from peft import PeftModel

    from shardwise.cli.main import main

    run = world["root"] / "run_lora"
    assert main(["export", str(run), "--format", "hf", str(tmp_path / "m")]) == 0
    assert main(["export", str(run), "--format", "peft", str(tmp_path / "a")]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(world["dirs"]["mixtral"]).eval()
    with torch.no_grad():
        plain = base(IDS).logits  # (before peft injects the adapters into `base`)
        theirs = PeftModel.from_pretrained(base, tmp_path / "a").eval()(IDS).logits
    merged = _exported_logits(tmp_path / "m")
    assert (theirs - plain).abs().max() > 1e-4  # the adapters moved the model ...
    diff = (merged - theirs).abs().max().item()
    assert diff <= 1e-5, diff  # ... and the merged export is that model


@pytest.mark.parametrize(
    ("extra", "world_size", "message"),
    [
        (["--parallel.tp=2"], 2, r"parallel.tp=2 with a Hugging Face MoE .*needs parallel.sp=true"),
        (
            ["--parallel.tp=2", "--parallel.sp=true", "--data.pack=true"],
            2,
            r"data.pack=true with parallel.sp=true is not built .*Fix: --data.pack=false",
        ),
        (
            ["--parallel.pp=2", "--train.micro_batch=2", "--parallel.pp_schedule=zb"],
            2,
            r"pp_schedule='zb' with routed experts \(the checkpoint's num_local_experts=4\)",
        ),
        (["--train.moe_aux_loss=0.01"], 1, r"train.moe_aux_loss applies to shardwise's own"),
        (["--train.moe_bias_balance=0.001"], 1, r"train.moe_bias_balance applies"),
        (["--model.n_experts=8"], 1, r"model.n_experts applies to shardwise's own MoE"),
    ],
)
def test_what_is_not_built_is_refused_with_the_key(world, extra, world_size, message):
    """Tensor parallelism without sequence parallelism (the experts stay whole, so every tp
    rank would compute every token's experts), tp + sp on packed rows (their positions are per
    record), the zero-bubble pipeline schedule (its
    split backward is not checked with routed experts; 1F1B, GPipe and interleaved stages run:
    tests/test_hf_moe_parallel.py) and shardwise's balance keys (their routers are the checkpoint's)
    stop before launch. (tp + sp, pp and pp x tp + sp run: tests/test_hf_moe_parallel.py; LoRA
    on the stacked experts trains: tests/test_moe_lora.py.)"""
    with pytest.raises(ConfigError, match=message):
        derive(load_config(None, _lm(world, "mixtral", *extra)), world_size)


def test_olmoe_tp_is_refused(world):
    """OLMoE publishes a tp plan of gathered outputs (its q/k norms span every head, which a
    split would cut): refused with sp too. (OLMoE publishes no base_model_pp_plan either, but
    its stages are Llama's: pp runs. Qwen3-MoE's per-head norms run under tp + sp:
    tests/test_hf_moe_parallel.py.)"""
    sp = ["--parallel.tp=2", "--parallel.sp=true"]
    with pytest.raises(ConfigError, match=r"OlmoeForCausalLM publishes a plan with entries"):
        derive(load_config(None, _lm(world, "olmoe", *sp)), 2)
