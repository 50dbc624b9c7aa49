"""Context parallelism for transformers' Llama-style causal LMs (parallel/context_hf.py): the
model's own attention calls the cp kernels through transformers' attention registry, its
rotary embedding reads the global positions.

fp32, 6 steps at seq_len 64 of `hf-llama-tiny` (2 layers, 4 query and 2 k/v heads: the k/v
repeat is exercised) and of Llama, Mistral, Qwen2 and Qwen3 checkpoints made here
(`model.name=hf`; Qwen3's q and k normed per head, 16 channels wide):
every cp layout must reproduce the single process's losses and final parameters, for the
reason tests/test_context_parallel.py gives (each rank's loss is its zig-zag part of the
sequence over the global token count, gradients summed over dp, which holds the cp ranks).
Packed instruction records (data.pack, tests/test_packing.py's Alpaca rows of 384 tokens, two
records each, LoRA, 4 steps) through the checkpoint of tests/test_instruct.py (`model.name=hf`)
and the preset: cp 2 and 4, ring and Ulysses, must reproduce the single process's losses,
gradient norms and parameters, each query attending within its own record and RoPE reading
positions within the record, and the planner must predict their cp traffic exactly.
Composed (dp 1 in the 4-rank world): cp 2 x tp 2 ring on the preset and on the Llama, Mistral,
Qwen2 and Qwen3 checkpoints (each rank's cp kernels get its n_heads / tp heads), cp 2 x pp 2 ring on
the checkpoints and Ulysses on Llama's (its stages rotate by the global positions of the
rank's zig-zag part and exchange activations of the local length) must reproduce the single
process's losses, gradient norms and parameters; under tp the planner must predict cp, tp
and dp traffic and the model states exactly, under pp (and for packed rows) every memory
category and the cp, pp and dp traffic. One 4-rank world runs every multi-rank case, one
process the references."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.config import load_config  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.job.explain import explain_record  # noqa: E402
from shardwise.launchers.harness import run_named_worlds  # noqa: E402
from shardwise.plan.hardware import get_hardware  # noqa: E402
from shardwise.training.validate import derive  # noqa: E402
from support.compare import SMALL, VOCAB, assert_reproduces, case  # noqa: E402
from test_instruct import instruction_checkpoint  # noqa: E402
from test_packing import _overrides as _packed_overrides  # noqa: E402

STEPS = 6
SHORT = [f"--train.steps={STEPS}", "--data.seq_len=64", "--optim.warmup_steps=2"]
PRESET = "--model.name=hf-llama-tiny"
# checkpoints of the shape SMALL gives the preset; the vocabulary is the BPE the data trains
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
CHECKPOINTS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,  # its 4096-token window covers the 64 tokens
    "qwen2": transformers.Qwen2Config,
    # q/k normed per head before RoPE; heads 16 wide on the 128-wide model
    "qwen3": functools.partial(transformers.Qwen3Config, head_dim=16),
}
CP2, ULYSSES, CP4 = ["--parallel.cp=2"], ["--parallel.cp_mode=ulysses"], ["--parallel.cp=4"]
PRESET_CASES = {
    "cp2_ring": CP2,  # dp 2 x cp 2
    "cp2_ulysses": [*CP2, *ULYSSES],
    "cp4_ring": CP4,
    "cp2_z3": [*CP2, "--parallel.zero=3"],
}
TP2, PP2 = ["--parallel.tp=2"], ["--parallel.pp=2", "--train.micro_batch=2"]
# cp composed with tp and pp (the checkpoint's cases are named after it, the preset's not)
COMPOSED_CASES = {
    "cp2_tp2_ring": [*CP2, *TP2],
    "llama_cp2_tp2_ring": [*CP2, *TP2],
    "llama_cp2_pp2_ring": [*CP2, *PP2],
    "llama_cp2_pp2_ulysses": [*CP2, *PP2, *ULYSSES],
    "mistral_cp2_tp2_ring": [*CP2, *TP2],
    "mistral_cp2_pp2_ring": [*CP2, *PP2],
    "qwen2_cp2_tp2_ring": [*CP2, *TP2],  # q/k/v biases split with their heads
    "qwen2_cp2_pp2_ring": [*CP2, *PP2],
    "qwen3_cp2_tp2_ring": [*CP2, *TP2],  # its per-head q/k norms' gradients summed over tp
    "qwen3_cp2_pp2_ring": [*CP2, *PP2],
}
# packed rows: the checkpoint (model.name=hf) in every mode, the preset at each degree
PACKED_CASES = {
    "packed_cp2_ring": CP2,
    "packed_cp2_ulysses": [*CP2, *ULYSSES],
    "packed_cp4_ring": CP4,
    "packed_cp4_ulysses": [*CP4, *ULYSSES],
    # recomputed blocks attend again in backward, within the records of their own forward
    "packed_cp2_ring_full": [*CP2, "--memory.recompute=full"],
    "packedpreset_cp2_ring": CP2,
    "packedpreset_cp4_ulysses": [*CP4, *ULYSSES],
}


def _checkpoint_case(path, *extra: str) -> dict:
    """SMALL for model.name=hf: the checkpoint sets the shape, the data trains its BPE."""
    shaped = ("--model.n_layers", "--model.vocab_size")
    small = [o for o in SMALL if not o.startswith(shaped)]
    hf = ["--model.name=hf", f"--model.init_from={path}", "--data.tokenizer=bpe"]
    return {"overrides": [*small, *SHORT, *hf, *extra]}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cp_hf")
    out = {}
    for name, config in CHECKPOINTS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config(**SHAPE))
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def packed_root(tmp_path_factory):
    """tests/test_instruct.py's tiny Llama checkpoint, its tokenizer and Alpaca records."""
    root = tmp_path_factory.mktemp("cp_hf_packed")
    instruction_checkpoint(root, max_positions=512)
    return root


def _packed_base(root, name: str) -> list[str]:
    """The reference's overrides of packed case `name`: the checkpoint, or the preset (its own
    init, a small vocabulary, the checkpoint's tokenizer)."""
    base = _packed_overrides(root)
    if not name.startswith("packedpreset"):
        return base
    mine = [o for o in base if not o.startswith(("--model.name", "--model.init_from"))]
    preset = [PRESET, "--model.n_layers=2", f"--model.vocab_size={VOCAB}"]
    return [*mine, *preset, f"--data.tokenizer={root / 'ckpt'}"]


def _composed_case(made: dict, name: str) -> dict:
    """The harness case of composed layout `name`: a checkpoint's (named first) or the
    preset's."""
    extra, first = COMPOSED_CASES[name], name.split("_")[0]
    if first in CHECKPOINTS:
        return _checkpoint_case(made[first], *extra)
    return case(*SHORT, PRESET, *extra)


@pytest.fixture(scope="module")
def worlds(made, packed_root):
    world1 = {"preset": case(*SHORT, PRESET)}
    world4 = {name: case(*SHORT, PRESET, *extra) for name, extra in PRESET_CASES.items()}
    for name, path in made.items():
        world1[name] = _checkpoint_case(path)
        world4[f"{name}_cp2_ring"] = _checkpoint_case(path, *CP2)
    world4["llama_cp4_ulysses"] = _checkpoint_case(made["llama"], *CP4, *ULYSSES)
    for name in COMPOSED_CASES:
        world4[name] = _composed_case(made, name)
    for ref in ("packed", "packedpreset"):
        world1[ref] = {"overrides": _packed_base(packed_root, ref)}
    for name, extra in PACKED_CASES.items():
        world4[name] = {"overrides": [*_packed_base(packed_root, name), *extra]}
    return run_named_worlds({1: world1, 4: world4})


def _reference(name: str) -> str:
    first = name.split("_")[0]
    return first if first in (*CHECKPOINTS, "packed", "packedpreset") else "preset"


CASES = [*PRESET_CASES, *(f"{n}_cp2_ring" for n in CHECKPOINTS), "llama_cp4_ulysses"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_parity_with_single_process(worlds, name):
    """Losses within 1e-5 relative and parameters within 1e-5 on every rank, as for our own
    decoders: the split is exact up to fp32 summation order. It trained, and a position
    handed to RoPE, a causal mask of the local length or a missed k/v repeat would move the
    first loss already."""
    ref = worlds[1][_reference(name)][0]
    assert ref["losses"][-1] < ref["losses"][0] - 0.1
    assert len(ref["losses"]) == STEPS
    assert_reproduces(name, worlds[4][name], ref, grad_norms=False)
    for r in worlds[4][name]:
        assert r["records"][-1]["comm_bytes"]["cp"] > 0  # the kernels ran


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPOSED_CASES))
def test_cp_composes_with_tp_and_pp(worlds, name):
    """Losses and gradient norms within 1e-5 relative on every rank, and every rank's
    parameters (a tp rank's gathered to full shape, a stage's own) within 1e-5 of the single
    process's, all of them covered: the split is exact up to fp32 summation order. Stages
    rotating by the local positions 0..S/cp-1 instead moved the losses 4.2e-5 relative
    (measured at cp 2 x pp 2, ring and Ulysses)."""
    ref = worlds[1][_reference(name)][0]
    assert ref["losses"][-1] < ref["losses"][0] - 0.1  # it trained
    assert len(ref["losses"]) == STEPS
    assert_reproduces(name, worlds[4][name], ref, sharded=True)
    for rank in worlds[4][name]:
        assert rank["records"][-1]["comm_bytes"]["cp"] > 0  # the kernels ran


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in COMPOSED_CASES if "_tp2_" in n])
def test_the_plan_is_exact_under_tp(worlds, made, name):
    """comm_bytes and comm_calls over cp (each rank's n_heads / tp heads through the kernels),
    tp and dp (the gradient reduction over the dp x cp ranks) as explain predicts them, and
    every memory category (tp rank 0's shard over dp x cp; the kernels repeat each rank's own
    k/v heads to its own query heads), on every rank and step."""
    pred = _explain(_composed_case(made, name)["overrides"])
    for rank in worlds[4][name]:
        for rec in rank["records"]:
            for dim in ("cp", "tp", "dp"):
                assert rec["comm_bytes"][dim] == pred["comm_bytes"][dim] > 0, (dim, rec, pred)
                assert rec["comm_calls"][dim] == pred["comm_calls"][dim], (dim, rec, pred)
            assert rec["mem_bytes"] == pred["mem_bytes"], (rec["mem_bytes"], pred["mem_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in COMPOSED_CASES if "_pp2_" in n])
def test_the_plan_is_exact_under_pp(worlds, made, name):
    """A checkpoint cut into pipeline stages under cp (job/stages.py): comm_bytes and
    comm_calls over cp (each stage's layers through the kernels) and pp (activations of the
    rank's s/cp tokens) on every rank and step, over dp (the gradient reduction over the
    dp x cp ranks) rank 0's (the first stage's units, as explain prices them), and every
    memory category at the busiest stage (max over the ranks of each step): the stages'
    fake forwards at s/cp plus the kernels' saved bytes, byte for byte."""
    pred = _explain(_composed_case(made, name)["overrides"])
    ranks = worlds[4][name]
    for i, rank in enumerate(ranks):
        for rec in rank["records"]:
            for dim in ("cp", "pp", "dp") if i == 0 else ("cp", "pp"):
                assert rec["comm_bytes"][dim] == pred["comm_bytes"][dim] > 0, (dim, rec, pred)
                assert rec["comm_calls"][dim] == pred["comm_calls"][dim], (dim, rec, pred)
    for step in zip(*(rank["records"] for rank in ranks), strict=True):
        got = {k: max(rec["mem_bytes"][k] for rec in step) for k in step[0]["mem_bytes"]}
        assert got == pred["mem_bytes"], (got, pred["mem_bytes"])


def _explain(overrides: list[str]) -> dict:
    return explain_record(load_config(None, overrides), 4, get_hardware("cpu", calibrate=False))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PRESET_CASES))
def test_the_plan_is_exact(worlds, name):
    """explain against the engine's own counts, on every rank and step. Traffic: the cp
    pricing (plan/traffic.py `cp_traffic`) assumes the kernels' inputs, k/v repeated to the
    query heads and one positions all-gather per layer, and transformers' attention reaches
    the same kernels with the same tensors; the gradient reduction (ZeRO-3's gathers too)
    spans the dp x cp ranks. Memory: states over dp x cp, the fake forward at seq_len / cp,
    plus what the kernels save (plan/memory.py `cp_saved_bytes`) and the repeated k/v that
    transformers' SDPA does not keep (job/measured.py `repeated_kv_bytes`); measured exact
    here and at 512 tokens, where a missed term is a MiB."""
    pred = _explain(case(*SHORT, PRESET, *PRESET_CASES[name])["overrides"])
    for rank in worlds[4][name]:
        for rec in rank["records"]:
            for dim in ("cp", "dp"):
                assert rec["comm_bytes"][dim] == pred["comm_bytes"][dim] > 0, (dim, rec, pred)
                assert rec["comm_calls"][dim] == pred["comm_calls"][dim], (dim, rec, pred)
            for key, got in rec["mem_bytes"].items():
                assert pred["mem_bytes"][key] == got, (key, rec["mem_bytes"], pred["mem_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_rows_reproduce_one_process(worlds, name):
    """Losses and gradient norms within 1e-5 relative, parameters within 1e-5, on every rank:
    the split is exact up to fp32 summation order. The adapters trained (four LoRA steps on
    random weights barely move the loss); queries attending across records instead moved the
    losses 2.5e-5, the gradient norms 3.5e-2 and the parameters 4.5e-3 (measured at cp 2)."""
    ref = worlds[1][_reference(name)][0]
    assert any(v.abs().max() > 0 for k, v in ref["params"].items() if ".lora_B." in k)
    assert len(ref["losses"]) == 4
    assert_reproduces(name, worlds[4][name], ref)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_traffic_is_predicted_byte_for_byte(worlds, packed_root, name):
    """comm_bytes and comm_calls over cp (Ulysses gathers the record starts with the
    positions; the ring sends what it sends unpacked) and over dp (the adapters' gradients
    over the dp x cp ranks) as explain predicts them, on every rank and step."""
    cfg = load_config(None, [*_packed_base(packed_root, name), *PACKED_CASES[name]])
    pred = explain_record(cfg, 4, get_hardware("cpu", calibrate=False))
    for rank in worlds[4][name]:
        for rec in rank["records"]:
            for dim in ("cp", "dp"):
                assert rec["comm_bytes"][dim] == pred["comm_bytes"][dim] > 0, (dim, rec, pred)
                assert rec["comm_calls"][dim] == pred["comm_calls"][dim], (dim, rec, pred)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_memory_is_predicted_byte_for_byte(worlds, packed_root, name):
    """Every memory category of packed rows under cp as explain predicts it, on every rank
    and step: the fake forward at s/cp without the records' additive mask [b, 1, s/cp, s/cp]
    (a rank's part builds none: the kernels mask by record), its k/v repeated already (the
    mask turns SDPA's GQA off), plus the kernels' saved bytes, for Ulysses also the records'
    mask of the whole sequence that its SDPA keeps as fp32 [b, 1, s, s] in every layer."""
    cfg = load_config(None, [*_packed_base(packed_root, name), *PACKED_CASES[name]])
    pred = explain_record(cfg, 4, get_hardware("cpu", calibrate=False))["mem_bytes"]
    for rank in worlds[4][name]:
        for rec in rank["records"]:
            assert rec["mem_bytes"] == pred, (name, rec["mem_bytes"], pred)


def test_other_checkpoints_are_refused_by_model_type(tmp_path):
    """A checkpoint whose attention the cp transformation does not reach (GPT-2: learned
    positions, its own attention scale options) and a Mistral window shorter than the
    sequence each stop before launch, naming the value and the fix."""
    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4)
    transformers.AutoModelForCausalLM.from_config(gpt2).save_pretrained(tmp_path / "gpt2")
    windowed = transformers.MistralConfig(**{**SHAPE, "num_hidden_layers": 1}, sliding_window=32)
    transformers.AutoModelForCausalLM.from_config(windowed).save_pretrained(tmp_path / "mistral")
    for path, needles in (
        (tmp_path / "gpt2", ["'gpt2' model", "llama, mistral, qwen2", "--parallel.cp=1"]),
        (tmp_path / "mistral", ["sliding window of 32", "--data.seq_len=32 or less"]),
    ):
        cfg = load_config(None, _checkpoint_case(path, *CP2)["overrides"])
        with pytest.raises(ConfigError) as err:
            derive(cfg, 2)
        for needle in needles:
            assert needle in str(err.value), str(err.value)


def test_what_does_not_compose_is_refused():
    """Sequence parallelism stays refused under cp (cp's and sp's pre-hooks would each hand
    transformers' forward its positions; without cp it runs: tests/test_hf_sp.py); Ulysses
    needs the heads a tp rank holds to divide over cp (hf-llama-tiny: 4 heads / tp 2 = 2 over
    cp 4). Each stops before launch, naming the value and the fix."""
    for extra, world, needles in (
        ([*CP2, *TP2, "--parallel.sp=true"], 4, ["parallel.sp=true", "--parallel.sp=false"]),
        ([*CP4, *TP2, *ULYSSES], 8, ["/ tp(2) = 2 is not divisible by 4", "cp_mode=ring"]),
    ):
        with pytest.raises(ConfigError) as err:
            derive(load_config(None, case(*SHORT, PRESET, *extra)["overrides"]), world)
        for needle in needles:
            assert needle in str(err.value), str(err.value)
