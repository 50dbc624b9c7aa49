"""`precision.fp8` on transformers' causal LMs: the decoder layers' q/k/v/o and gate/up/down
projections of the hf-llama presets and of Llama, Mistral, Qwen2 and Qwen3 checkpoints
(`model.name=hf`) become FP8 layers through torchao (numerics mode on CPU), as the built-in
decoders' block linears do (tests/test_fp8.py); embeddings, lm_head and norms keep bf16. The
training runs below are the preset's and a Llama checkpoint's; the other checkpoints' layers
are checked to convert alike.

References and tolerances, those of tests/test_fp8.py for the same reasons:
* FP8 against bf16, one process, 50 steps of `hf-llama-tiny` (2 layers): the final loss
  within 2%, and the curve differs from bf16's (else nothing converted).
* dp2 ZeRO-3 (with and without LoRA on the FP8 base layers) and pp2 of a Llama checkpoint
  against one process's FP8 run at the same micro-batch (2 rows): every FP8 scale is a
  maximum over the same rows, so only fp32 summation order differs: losses within 1e-5.
* compiled blocks (`train.compile=blocks`) against eager FP8: within 2e-3 per step, the
  bound tests/test_fp8_compile.py derives for the built-in decoder.
* tp is refused (and the planner searches no tp layout for it): each tp rank would scale
  its own slices, checked for the built-in decoders only; so are checkpoints of other model
  types, whose layers the family does not name.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from shardwise.config import load_config  # noqa: E402
from shardwise.distributed import device as dev  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.finetune import build_adapted  # noqa: E402
from shardwise.launchers.harness import run_here, run_world  # noqa: E402
from shardwise.models import build_on_meta  # noqa: E402
from shardwise.models.families import family_of  # noqa: E402
from shardwise.parallel.fp8 import apply_fp8, is_fp8  # noqa: E402
from shardwise.plan import search  # noqa: E402
from shardwise.plan.hardware import get_hardware  # noqa: E402
from shardwise.plan.layout import Job, Layout  # noqa: E402
from shardwise.training.validate import derive  # noqa: E402
from support.compare import SMALL, VOCAB, case, max_rel  # noqa: E402
from test_context_parallel_hf import (  # noqa: E402 (the checkpoints: SMALL's shape, the BPE's vocabulary)
    CHECKPOINTS,
    SHAPE,
)

pytestmark = pytest.mark.slow

PRESET = "--model.name=hf-llama-tiny"
BF16 = [PRESET, "--precision.compute=bf16", "--train.micro_batch=2"]
FP8 = [*BF16, "--precision.fp8=tensorwise"]
SHORT = ["--train.steps=10", "--optim.warmup_steps=2"]
LORA = ["--finetune.lora_rank=16", "--finetune.lora_alpha=32"]
ZERO3 = ["--parallel.zero=3"]
CPU = dev.DeviceInfo("cpu", "gloo", torch.device("cpu"), "cpu")
BLOCK = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _checkpoint(path, *extra: str) -> dict:
    """A harness case of the checkpoint at `path` (it sets the shape; SMALL the rest)."""
    small = [o for o in SMALL if not o.startswith(("--model.n_layers", "--model.vocab_size"))]
    hf = ["--model.name=hf", f"--model.init_from={path}", "--data.tokenizer=bpe"]
    over = [o for o in FP8 if o != PRESET]
    return {"overrides": [*small, *over, *SHORT, *hf, *extra]}


def _save(path, config_class) -> None:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config_class(**SHAPE)).save_pretrained(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fp8_hf") / "llama"
    _save(path, transformers.LlamaConfig)
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, llama: str) -> dict:
    root = tmp_path_factory.mktemp("fp8_hf_runs")
    one = {
        "bf16": case(*BF16, "--train.steps=50"),
        "fp8": case(*FP8, "--train.steps=50"),
        "short": case(*FP8, *SHORT),
        "lora": case(*FP8, *SHORT, *LORA),
        "llama": _checkpoint(llama),
        "compiled": case(*FP8, *SHORT, "--train.compile=blocks"),
    }
    one = {name: run_here(c, str(root / name)) for name, c in one.items()}
    two = {  # each against the one-process run named by its first word
        "short_zero3": case(*FP8, *SHORT, *ZERO3),
        "lora_zero3": case(*FP8, *SHORT, *LORA, *ZERO3),
        "llama_pp2": _checkpoint(llama, "--parallel.pp=2"),
        "llama_zero3": _checkpoint(llama, *ZERO3),
    }
    world = run_world(2, list(two.values()))
    return {"one": one, "two": dict(zip(two, world, strict=True))}


def test_hf_llama_fp8_trains_as_bf16_does(runs) -> None:
    bf16, fp8 = runs["one"]["bf16"], runs["one"]["fp8"]
    assert "error" not in fp8, fp8.get("error")
    assert len(fp8["losses"]) == 50
    assert fp8["losses"][-1] < fp8["losses"][0] - 0.5  # it trained
    assert abs(fp8["losses"][-1] - bf16["losses"][-1]) <= 0.02 * bf16["losses"][-1]
    assert max_rel(fp8["losses"], bf16["losses"]) > 1e-5  # FP8 changed the numbers


@pytest.mark.parametrize("name", ["short_zero3", "lora_zero3", "llama_pp2", "llama_zero3"])
def test_hf_fp8_layouts_reproduce_one_process(runs, name: str) -> None:
    one = runs["one"][name.split("_")[0]]
    assert "error" not in one, one.get("error")
    for rank in runs["two"][name]:
        assert "error" not in rank, rank["error"]
        assert len(rank["losses"]) == 10
        assert max_rel(rank["losses"], one["losses"]) <= 1e-5


def test_hf_llama_compiled_fp8_stays_near_eager_fp8(runs) -> None:
    """Compiled blocks re-draw part of FP8's roundings: tests/test_fp8_compile.py's bound."""
    compiled = runs["one"]["compiled"]
    assert "error" not in compiled, compiled.get("error")
    assert len(compiled["losses"]) == 10
    assert max_rel(compiled["losses"], runs["one"]["short"]["losses"]) <= 2e-3


def _converted(model: nn.Module, family) -> set[str]:
    apply_fp8(model, family, "tensorwise", CPU)
    return {n for n, m in model.named_modules() if is_fp8(m)}


@pytest.mark.parametrize("lora", [False, True])
def test_only_the_decoder_layers_projections_convert(lora: bool) -> None:
    cfg = load_config(None, [*FP8, "--model.n_layers=2", *(LORA if lora else [])])
    spec = derive(cfg, 1).spec
    model = build_adapted(spec, cfg.finetune)[0] if lora else build_on_meta(spec)
    fp8 = _converted(model, family_of(spec))
    assert len(fp8) == 2 * 7
    parts = [n.removesuffix(".base_layer").split(".") for n in fp8]
    assert {p[-1] for p in parts} == BLOCK and all("layers" in p for p in parts)
    assert all(n.endswith(".base_layer") for n in fp8) == lora  # LoRA's adapters stay bf16
    assert not any(is_fp8(m) for n, m in model.named_modules() if "lm_head" in n)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_checkpoints_convert_the_decoder_layers_projections(tmp_path, name) -> None:
    path = tmp_path / name
    _save(path, CHECKPOINTS[name])
    cfg = load_config(None, _checkpoint(path)["overrides"])
    spec = derive(cfg, 1).spec
    fp8 = _converted(build_on_meta(spec), family_of(spec))
    assert len(fp8) == 2 * 7 and {n.split(".")[-1] for n in fp8} == BLOCK


def test_tensor_parallel_and_other_checkpoints_are_refused(tmp_path, llama: str) -> None:
    tp = "precision.fp8=tensorwise: parallel.tp=2 with model.name='{}'.*own slices.*Fix: --parallel"
    cfg = load_config(None, [*case(*FP8)["overrides"], "--parallel.tp=2"])
    with pytest.raises(ConfigError, match=tp.format("hf-llama-tiny")):
        derive(cfg, 2)
    cfg = load_config(None, [*_checkpoint(llama)["overrides"], "--parallel.tp=2"])
    with pytest.raises(ConfigError, match=tp.format("hf")):
        derive(cfg, 2)
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=VOCAB)
    transformers.AutoModelForCausalLM.from_config(gpt2).save_pretrained(tmp_path / "gpt2")
    cfg = load_config(None, _checkpoint(tmp_path / "gpt2")["overrides"])
    with pytest.raises(ConfigError, match=r"holds a 'gpt2' model.*llama, mistral, qwen2.*Fix"):
        derive(cfg, 1)
    cfg = load_config(None, case(*FP8, "--model.name=hf-gpt2-tiny")["overrides"])
    with pytest.raises(ConfigError, match=r"whose FP8 training is not tested.*Fix"):
        derive(cfg, 1)


def test_the_planner_searches_no_tp_for_fp8_on_transformers_models() -> None:
    hw = get_hardware("h100-sxm")
    lay = Layout(tp=2, dp=4, zero=1)
    for name, refused in (("hf-llama-tiny", True), ("tiny", False)):
        spec = derive(load_config(None, [f"--model.name={name}"]), 1).spec
        why = search.invalid(Job(spec, hw, 8, seq_len=32, global_batch=8, fp8="rowwise"), lay)
        assert (why or "").startswith("FP8 with tp") == refused
        assert search.invalid(Job(spec, hw, 8, seq_len=32, global_batch=8), lay) is None
