"""A head width of its own (`model.head_dim`, Qwen3's 32 heads of 128 on a 2048-wide model):
the decoder's q/k/v/o are n_heads·head_dim wide, tp and cp split those heads as the
single-process run has them, explain predicts the run's model states and activations exactly,
the planner counts the projections' real sizes, and the Hugging Face export (Llama with
head_dim) computes our logits in transformers.

tiny (dim 128, 4 heads, 2 k/v heads) with heads of 48: queries 192 wide on a 128-wide model.
One 2-rank world runs the multi-rank cases, one process the reference."""

from types import SimpleNamespace

import pytest
import torch

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.launchers.harness import run_named_worlds
from support.compare import case, max_param_diff, max_rel

HD = ["--model.head_dim=48"]
SHORT = ["--train.steps=6", "--optim.warmup_steps=2"]
WORLD1 = {"ref": case(*SHORT, *HD)}
WORLD2 = {
    "tp2": case(*SHORT, *HD, "--parallel.tp=2"),
    "cp2_ring": case(*SHORT, *HD, "--parallel.cp=2"),
    "cp2_ulysses": case(*SHORT, *HD, "--parallel.cp=2", "--parallel.cp_mode=ulysses"),
}
STATES = ("params", "grads", "master", "optimizer", "activations")


@pytest.fixture(scope="module")
def worlds():
    return run_named_worlds({1: WORLD1, 2: WORLD2})


def test_the_decoder_projects_to_n_heads_times_head_dim():
    from shardwise.models import build_model
    from shardwise.training.validate import model_spec

    spec = model_spec(load_config(None, ["--model.n_layers=1", *HD]))
    assert (spec.head_dim, spec.q_dim, spec.dim) == (48, 192, 128)
    attn = build_model(spec).blocks[0].attn
    shapes = [tuple(getattr(attn, n).weight.shape) for n in ("wq", "wk", "wv", "wo")]
    assert shapes == [(192, 128), (96, 128), (96, 128), (128, 192)]


@pytest.mark.parametrize("name", list(WORLD2))
def test_tp_and_cp_split_the_wider_heads_as_one_process_runs_them(worlds, name):
    ref = worlds[1]["ref"][0]
    assert ref["losses"][-1] < ref["losses"][0] - 0.1  # it trained
    for r in worlds[2][name]:
        assert max_rel(r["losses"], ref["losses"]) <= 1e-5
        assert max_param_diff(r["params"], ref["params"]) <= 1e-5


@pytest.mark.parametrize(("name", "world"), [("ref", 1), ("tp2", 2)])
def test_explain_predicts_the_states_and_activations_exactly(worlds, name, world):
    from shardwise.job.explain import explain_record

    cases = WORLD1 if world == 1 else WORLD2
    predicted = explain_record(load_config(None, cases[name]["overrides"]), world)
    measured = worlds[world][name][0]["records"][-1]["mem_bytes"]
    for key in STATES:
        assert predicted["mem_bytes"][key] == measured[key], key


def test_the_planners_flops_count_the_projections_real_sizes():
    from shardwise.models import build_model
    from shardwise.models.presets import ModelSpec
    from shardwise.plan import gpu
    from shardwise.plan.hardware import get_hardware
    from shardwise.plan.layout import Job
    from shardwise.plan.time import model_flops_per_token
    from shardwise.training.metrics import count_params

    L, h, H, kv, hd, f, V, s = 2, 64, 4, 2, 32, 96, 512, 128  # queries 128 wide on 64
    spec = ModelSpec("decoder", L, h, H, kv, f, V, head_dim_override=hd)
    q, k = H * hd, kv * hd
    per_block = h * q + 2 * h * k + q * h + 3 * h * f + 2 * h  # wq wk wv wo, SwiGLU, 2 norms
    n = L * per_block + h + h * V  # the final norm and the head (the embedding is a lookup)
    with torch.device("meta"):
        assert count_params(build_model(spec), exclude_embedding=True) == n
    job = Job(spec, get_hardware("h100-sxm"), 1, seq_len=s, global_batch=1)
    assert model_flops_per_token(job) == 6 * n + 12 * L * q * s  # attention H·hd wide, not h
    assert model_flops_per_token(job, causal=True) == 6 * n + 6 * L * q * s
    # the kernel model's GEMMs (per token) are the block's linear weights, once each
    gemms = gpu._gemms(spec, 1, 1.0)
    assert sum(m * n_ * k_ for m, n_, k_ in gemms) == per_block - 2 * h
    assert (1.0, h, q) in gemms  # the output projection reads the 128-wide attention


def test_the_hf_export_is_llama_with_head_dim_and_gives_our_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from shardwise.checkpoint.export_model import hf_dir_spec
    from shardwise.cli.main import main
    from shardwise.launchers.harness import run_here
    from shardwise.models import build_model
    from shardwise.training.validate import model_spec

    over = ["--model.n_layers=1", "--data.seq_len=32", *HD]
    result = run_here(
        {"overrides": [*over, "--train.steps=2", "--checkpoint.every=2"]}, str(tmp_path / "run")
    )
    assert "error" not in result, result.get("error")
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "run"), "--format", "hf", str(out)]) == 0
    spec = model_spec(load_config(None, over))
    ours = build_model(spec).eval()
    ours.load_state_dict(result["params"])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert theirs.config.head_dim == 48
    assert tuple(theirs.model.layers[0].self_attn.q_proj.weight.shape) == (192, 128)
    tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff
    # and read back (model.init_from of the folder): the spec keeps the width
    assert hf_dir_spec(out).head_dim == 48


def test_a_checkpoint_configs_head_dim_is_read_where_it_is_its_own():
    from shardwise.models.hf import llama
    from shardwise.models.spec import hf_head_dim

    qwen3 = {"hidden_size": 2048, "num_attention_heads": 32, "head_dim": 128}
    assert hf_head_dim(SimpleNamespace(**qwen3)) == 128
    assert hf_head_dim(SimpleNamespace(**{**qwen3, "head_dim": 64})) == 0  # = 2048 / 32
    assert hf_head_dim(SimpleNamespace(hidden_size=2048, num_attention_heads=32)) == 0
    cfg = {
        **qwen3,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "vocab_size": 512,
        "num_key_value_heads": 4,
    }
    assert llama.fields(cfg, "x")["head_dim_override"] == 128


def test_plan_reads_a_qwen3_config_jsons_head_width_and_qk_norms(tmp_path):
    """`plan --model config.json` of a family priced from its real modules (Qwen3) keeps the
    config's own head width and its per-head q/k norms, as the spec `train` makes of the same
    checkpoint does: the plan's spec read 64 / 4 = 16 and no q/k norms before."""
    transformers = pytest.importorskip("transformers")
    from shardwise.plan.shapes import spec_from_hf_config

    transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=96,
    ).save_pretrained(tmp_path)
    spec = spec_from_hf_config(str(tmp_path / "config.json"))
    assert (spec.arch, spec.head_dim, spec.q_dim, spec.qk_norm) == ("hf", 32, 128, True)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--model.head_dim=-8"], ["model.head_dim=-8", "positive"]),
        (["--model.head_dim=47"], ["model.head_dim=47", "odd", "even"]),
        (["--model.name=gpt2-tiny", "--model.head_dim=32"], ["model.head_dim=32", "Llama-style"]),
        (["--model.name=resnet18", "--model.head_dim=32"], ["model.head_dim", "ResNet"]),
    ],
)
def test_a_bad_head_dim_is_one_clear_error(args, needles):
    from shardwise.training.validate import model_spec

    with pytest.raises(ConfigError) as err:
        model_spec(load_config(None, args))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_a_head_width_of_its_own_needs_no_divisible_dim():
    from shardwise.models.presets import ModelSpec

    assert ModelSpec("decoder", 1, 100, 3, 1, 64, 512, head_dim_override=32).q_dim == 96
    with pytest.raises(ConfigError, match=r"model\.head_dim"):  # the fix names the key
        ModelSpec("decoder", 1, 100, 3, 1, 64, 512)


@pytest.mark.parametrize("name", ["tiny", "moe-tiny"])
def test_the_planners_units_are_the_built_models_with_wider_heads(name):
    """ZeRO units (every parameter's shape) as the planner counts them, against the model
    each family builds with heads of 48: our decoder and our MoE decoder."""
    from shardwise.job.predict import model_units
    from shardwise.models import build_model
    from shardwise.plan.shapes import units
    from shardwise.training.validate import model_spec

    spec = model_spec(load_config(None, [f"--model.name={name}", "--model.n_layers=2", *HD]))
    assert spec.q_dim == 4 * 48 != spec.dim
    with torch.device("meta"):
        real = model_units(build_model(spec))
    flat = [[e[:2] for e in u.entries] for u in units(spec) for _ in range(u.count)]
    assert [[e[:2] for e in u.entries] for u in real] == flat


def test_transformers_llama_preset_takes_the_head_width():
    pytest.importorskip("transformers")
    from shardwise.models import build_model
    from shardwise.training.validate import model_spec

    over = ["--model.name=hf-llama-tiny", "--model.n_layers=1", *HD]
    with torch.device("meta"):
        attn = build_model(model_spec(load_config(None, over))).model.layers[0].self_attn
    shapes = [tuple(getattr(attn, n).weight.shape) for n in ("q_proj", "k_proj", "o_proj")]
    assert shapes == [(192, 128), (96, 128), (128, 192)]


def test_a_misaligned_head_width_of_its_own_is_fixed_by_that_key():
    from shardwise.job.explain import alignment_warning
    from shardwise.plan.hardware import get_hardware
    from shardwise.training.validate import model_spec

    spec = model_spec(load_config(None, ["--model.head_dim=36"]))
    warning = alignment_warning(spec, "bf16", get_hardware("h100-sxm"))
    assert "head dim 36" in warning and "Fix: e.g. --model.head_dim=40." in warning
    assert "n_heads" not in warning.split("Fix:")[1]  # (dim / n_heads is not the width here)


def test_the_runs_mfu_counts_the_attention_at_its_own_width():
    """metrics.jsonl's FLOPs per token (training/metrics.py, from the built model) are the
    planner's for the same config: both count the attention n_heads · head_dim wide."""
    from shardwise.models import build_model
    from shardwise.plan.hardware import get_hardware
    from shardwise.plan.layout import Job
    from shardwise.plan.time import model_flops_per_token
    from shardwise.training.metrics import flops_per_token
    from shardwise.training.validate import derive

    d = derive(load_config(None, ["--model.n_layers=2", "--data.seq_len=64", *HD]), 1)
    with torch.device("meta"):
        ours = flops_per_token(build_model(d.spec), d)
    job = Job(d.spec, get_hardware("h100-sxm"), 1, seq_len=64, global_batch=1)
    assert ours == model_flops_per_token(job)


def test_a_qwen3_checkpoint_brings_its_head_width(tmp_path):
    """model.name=hf of a Qwen3 checkpoint (heads of 48 on a 64-wide model): the spec the
    planner prices carries the config's head_dim."""
    transformers = pytest.importorskip("transformers")
    from shardwise.models.spec import spec_from_config

    cfg = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=48, max_position_embeddings=64,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    over = ["--model.name=hf", f"--model.init_from={tmp_path}", "--data.seq_len=32"]
    spec = spec_from_config(load_config(None, over))
    assert (spec.head_dim, spec.q_dim, spec.dim) == (48, 192, 64)
