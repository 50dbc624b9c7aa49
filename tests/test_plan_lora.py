"""The planner's LoRA coverage beyond targets every block has: targets naming some blocks only
(`blocks.1.attn.wq`, transformers' `transformer.h.1.attn.c_attn`), the first adapted block's
saved tensors when its first adapter is the output projection or the MLP (with and without
LoRA dropout, with and without selective recomputation), and the frozen base of an adapted
MoE router under finetune.base_quant.

`plan`'s per-candidate prediction (the formula; an MoE decoder's from its real units and fake
forwards, as `plan` prices it) against `explain` (the real model's units and, for
transformers' classes, its fake forward), against the engine's saved-tensor meter on the
adapted model's fake forward, and against measured one- and two-process runs: byte for byte
in every category where both sides are exact (an MoE run's activations follow its routing:
only its model states and buffers are compared there). Under tp, the traffic and collective
calls too, for any first adapted linear; and the explicit softmax of attention dropout."""

from __future__ import annotations

import json

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("peft")

from shardwise.cli.main import main
from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.job.describe import job_from_config, layout_from_config
from shardwise.job.explain import explain_record
from shardwise.job.fake import fake_activations, local_config, meta_model, to_fake
from shardwise.launchers.harness import run_named_worlds
from shardwise.plan.hardware import get_hardware
from shardwise.plan.search import evaluate
from shardwise.plan.valid import SOME_BLOCKS
from shardwise.training.validate import derive
from support.compare import case

CPU = get_hardware("cpu", calibrate=False)
LORA = ["--finetune.lora_rank=4", "--train.steps=1"]
DROP = ["--finetune.lora_dropout=0.1"]
STATES = ("params", "grads", "master", "optimizer", "buffers")
ATTN = ["--model.attn_dropout=0.1"]  # the explicit softmax path (models/decoder._explicit)
TP, SP = ["--parallel.tp=2"], ["--parallel.tp=2", "--parallel.sp=true"]
SEL = ["--memory.recompute=selective"]
MOE = ["--model.name=moe-tiny", "--model.n_layers=2", "--finetune.lora_targets=router,wq"]
GPT2_BLOCK1 = ["--model.name=hf-gpt2-tiny", "--finetune.lora_targets=transformer.h.1.attn.c_attn"]


def _formula(cfg, ranks: int) -> dict:
    """The memory of `_planned`."""
    return _planned(cfg, ranks)["mem_bytes"]


def _planned(cfg, ranks: int) -> dict:
    """`plan`'s prediction of exactly this config (cli/plan.py: an MoE decoder from its real
    units and fake forwards at one and two samples, job/real.py)."""
    d = derive(cfg, ranks)
    job = job_from_config(cfg, CPU, ranks, d.spec)
    if d.spec.n_experts:
        from shardwise.job.real import real_job

        job = real_job(job, cfg)
    return evaluate(job, layout_from_config(cfg, d))


def _split_moe(cfg) -> bool:
    """An MoE decoder under tp: `plan` prices its blocks from the real model at tp = pp = 1
    only (job/real.py, plan/valid.py), so `explain` alone predicts it."""
    return cfg.parallel.tp > 1 and bool(derive(cfg, cfg.parallel.tp).spec.n_experts)


def _metered(cfg) -> int:
    """The engine's saved-tensor meter on the adapted model's fake forward (one process)."""
    d = derive(cfg, 1)
    model = meta_model(cfg, d.spec)
    with FakeTensorMode():
        to_fake(model)
        return fake_activations(model, local_config(cfg, 1), d)


@pytest.mark.parametrize("drop", [[], DROP], ids=["", "dropout"])
@pytest.mark.parametrize(
    ("name", "targets"),
    [
        *(("tiny", t) for t in ("wq", "wv", "wo", "w1", "w3", "w2", "wo,w2")),
        *(("gpt2-tiny", t) for t in ("wv", "wo", "w1", "w2")),
        # some blocks only: the blocks before the first adapted one save nothing
        *(("tiny", t) for t in ("blocks.1.attn.wq", "blocks.0.mlp.w2", "blocks.[12].attn.wo,w1")),
        ("tiny-bf16", "wo"),
        ("tiny-bf16", "blocks.2.mlp.w3"),
        ("tiny-resid", "w1"),  # residual and embedding dropout: no masks without a gradient
        # attention dropout's explicit softmax: in the first block q @ kᵀ, the softmax and
        # probs @ v save what the adapted ones' gradients read; wo's input only for wo's
        *(("tiny-attn", t) for t in ("wq", "wk", "wv", "wq,wk", "wk,wv", "wo", "w1", "all-linear")),
        ("gpt2-tiny-attn", "wv"),
        # selective recomputation: the recomputed core saves no output (wo's input only for
        # wo's adapter) and the regions' inputs are saved with or without a gradient (in the
        # first adapted block and the unadapted ones before it too)
        *(("tiny-sel", t) for t in ("wq", "wo", "w1", "w3", "w2", "all-linear")),
        *(("tiny-sel", t) for t in ("blocks.1.attn.wq", "blocks.[12].attn.wo,w1")),
        *(("gpt2-tiny-sel", t) for t in ("wv", "w1")),
        ("tiny-attn-sel", "w1"),
    ],
)
def test_our_blocks_formula_is_the_engine_meter(name, targets, drop):
    """Our decoders' activations by formula equal the meter on the adapted model's fake
    forward: the first adapted block saves nothing before its first adapter's input (norms,
    attention, RoPE tables of an unadapted q or k), no mask for that adapter's dropout, no
    SDPA output when that input is wo's; a gated MLP with one of its two linears adapted keeps
    one factor; the frozen embedding saves no ids and no dropout mask. With attention dropout
    (its explicit softmax, no SDPA output) wo's input is kept for wo's adapter only, and so
    under selective recomputation, whose checkpointed attention core and MLP activation keep
    their inputs in every block, adapted or not."""
    extra = {"tiny-bf16": ["--precision.compute=bf16"], "tiny-resid": ["--model.dropout=0.1"]}
    extra.update({"tiny-attn": ATTN, "gpt2-tiny-attn": ATTN, "tiny-attn-sel": [*ATTN, *SEL]})
    extra.update({"tiny-sel": SEL, "gpt2-tiny-sel": SEL})
    model = "gpt2-tiny" if name.startswith("gpt2-tiny") else "tiny"
    over = [f"--model.name={model}", "--model.n_layers=3", f"--finetune.lora_targets={targets}"]
    cfg = load_config(None, case(*LORA, *over, *extra.get(name, []), *drop)["overrides"])
    assert _formula(cfg, 1)["activations"] == _metered(cfg)


@pytest.mark.parametrize(
    ("name", "targets", "extra"),
    [
        ("hf-gpt2-tiny", "transformer.h.1.attn.c_attn", []),
        ("hf-gpt2-tiny", "transformer.h.1.attn.c_attn", DROP),
        ("hf-gpt2-tiny", "transformer.h.0.mlp.c_proj", ["--precision.compute=bf16"]),
        ("hf-gpt2-tiny", "transformer.h.[12].attn.c_attn,c_fc", ["--parallel.zero=3"]),
        ("hf-llama-tiny", "model.layers.1.self_attn.q_proj", DROP),
        # o_proj of the last layer only: no rotation anywhere has a gradient (no RoPE tables)
        ("hf-llama-tiny", "model.layers.2.self_attn.o_proj", []),
        ("hf-llama-tiny", "model.layers.0.mlp.down_proj,model.layers.2.mlp.up_proj", []),
        ("tiny", "blocks.1.attn.wo,blocks.2.mlp.w1", ["--finetune.base_quant=nf4"]),
        ("tiny", "blocks.0.attn.wq,blocks.2.attn.wv", ["--parallel.zero=3", *DROP]),
    ],
)
def test_some_blocks_formula_is_explain(name, targets, extra):
    """Targets naming some blocks only, which `plan` refused on transformers' presets and
    priced on every block of ours: the formula (units block by block, a quantised base only
    where adapted, each block's saved tensors by its own targets) equals `explain` of the real
    model in every category, on one process or two (ZeRO-3)."""
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    ranks = 2 if "--parallel.zero=3" in extra else 1
    shape = ["--model.n_layers=3", "--data.seq_len=32", "--train.global_batch=8"]
    over = [f"--model.name={name}", *shape, "--train.micro_batch=4", *LORA, *extra]
    cfg = load_config(None, [*over, f"--finetune.lora_targets={targets}"])
    assert _formula(cfg, ranks) == explain_record(cfg, ranks, CPU)["mem_bytes"]


def _measured_cases() -> dict[int, dict[str, dict]]:
    one = {
        "wo_drop": case(*LORA, *DROP, "--finetune.lora_targets=wo"),
        "w1_drop": case(*LORA, *DROP, "--finetune.lora_targets=w1"),
        "w2_drop": case(*LORA, *DROP, "--finetune.lora_targets=w2"),
        "block1_nf4": case(
            *LORA, "--finetune.lora_targets=blocks.1.attn.wo", "--finetune.base_quant=nf4"
        ),
        "gpt2_block1": case(*LORA, *GPT2_BLOCK1),
        "moe_nf4": case(*LORA, *MOE, "--finetune.base_quant=nf4"),
        "moe_int8": case(*LORA, *MOE, "--finetune.base_quant=int8"),
        "attn_drop_all": case(*LORA, *ATTN),
        "attn_drop_wq": case(*LORA, *ATTN, "--finetune.lora_targets=wq"),
        "attn_drop_w1_drop": case(*LORA, *ATTN, *DROP, "--finetune.lora_targets=w1"),
        # selective recomputation: the first block's attention core keeps q, k, v though
        # nothing there has a gradient; wo's input is kept for wo's adapter only
        "sel_w1": case(*LORA, *SEL, "--finetune.lora_targets=w1"),
        "sel_wq_drop": case(*LORA, *SEL, *DROP, "--finetune.lora_targets=wq"),
    }
    z3 = "--parallel.zero=3"
    two = {
        "block1_z3": case(*LORA, *DROP, "--finetune.lora_targets=blocks.1.mlp.w1", z3),
        "moe_nf4_z3": case(*LORA, *MOE, "--finetune.base_quant=nf4", z3),
        # tp: each rank's first block saves its share only from wo's dropped input on
        "tp2_wo_drop": case(*LORA, *DROP, "--finetune.lora_targets=wo", "--parallel.tp=2"),
        # tp traffic: no backward collective before the first adapted linear (the embedding's
        # exit, the first block's entries and exits), only the adapters' partial gradients
        "tp2_w2": case(*LORA, *TP, "--finetune.lora_targets=w2"),
        "tp2_sp_wq": case(*LORA, *SP, "--finetune.lora_targets=wq"),
        "tp2_sp_w1": case(*LORA, *SP, "--finetune.lora_targets=w1"),
        "tp2_sp_full_wo": case(*LORA, *SP, "--finetune.lora_targets=wo", "--memory.recompute=full"),
        "tp2_sp_sel_w2_drop": case(*LORA, *SP, *SEL, *DROP, "--finetune.lora_targets=w2"),
        "tp2_sp_gpt2_w2": case(*LORA, *SP, "--model.name=gpt2-tiny", "--finetune.lora_targets=w2"),
        "tp2_attn_drop_wv": case(*LORA, *TP, *ATTN, "--finetune.lora_targets=wv"),
        "tp2_llama_up": case(
            *LORA, *TP, "--model.name=hf-llama-tiny", "--finetune.lora_targets=up_proj"
        ),
        "moe_sp": case(*LORA, *MOE, *SP),
        "moe_sp_router": case(*LORA, *MOE, *SP, "--finetune.lora_targets=router"),
    }
    return {1: one, 2: two}


@pytest.fixture(scope="module")
def runs():
    pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    cases = _measured_cases()
    return cases, run_named_worlds(cases)


@pytest.mark.parametrize(
    ("ranks", "name"),
    [(1, n) for n in _measured_cases()[1]] + [(2, n) for n in _measured_cases()[2]],
)
def test_formula_explain_and_a_measured_run_agree(runs, ranks, name):
    """The formula, `explain` and a measured run (max over ranks) agree byte for byte: the
    model states and buffers (an adapted MoE router's base quantised as the engine quantises
    every adapted linear's: outside the ZeRO units, split under ZeRO-3) and, for our decoders
    and transformers' GPT-2, the activations the engine's saved-tensor hooks counted."""
    cases, results = runs
    cfg = load_config(None, cases[ranks][name]["overrides"])
    told = explain_record(cfg, ranks, CPU)["mem_bytes"]
    formula = told if _split_moe(cfg) else _formula(cfg, ranks)
    ran = [r["records"][-1]["mem_bytes"] for r in results[ranks][name]]
    keys = STATES if name.startswith("moe") else (*STATES, "activations")
    for key in keys:
        measured = max(r[key] for r in ran)
        assert formula[key] == told[key] == measured, (key, formula[key], told[key], measured)


def test_some_blocks_are_priced_in_one_unsplit_stage():
    """Targets naming some blocks only are priced at tp = pp = cp = 1: `plan` offers no other
    layout (counting why), and `explain` of one refuses with the targets and the fix."""
    over = ["--model.name=tiny", *LORA, "--finetune.lora_targets=blocks.1.attn.wq"]
    with pytest.raises(ConfigError) as err:
        explain_record(load_config(None, [*over, "--parallel.tp=2"]), 2, CPU)
    text = str(err.value)
    assert "finetune.lora_targets='blocks.1.attn.wq'" in text and "tp=2" in text, text
    assert "--parallel.tp=1" in text and "blocks.*.attn.wq" in text, text


def test_plan_prices_some_blocks_and_refuses_a_pattern_that_matches_none(capsys):
    """`plan` on transformers' GPT-2 with a one-layer target: candidates at tp = pp = 1 only,
    the rest rejected for it; a layer the model lacks is refused naming the pattern."""
    pytest.importorskip("transformers")
    args = ["plan", "--hardware", "h100", "--devices", "2", "--model", "hf-gpt2-tiny"]
    lora = ["--finetune.lora_rank=4", "--model.n_layers=2", "--json", "--top", "100"]
    assert main([*args, *lora, "--finetune.lora_targets=transformer.h.1.attn.c_attn"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["candidates"]
    assert all(c["tp"] == 1 and c["pp"] == 1 for c in out["candidates"])
    assert SOME_BLOCKS in out["rejected"], out["rejected"]
    assert main([*args, *lora, "--finetune.lora_targets=transformer.h.7.attn.c_attn"]) == 2
    err = capsys.readouterr().err
    assert "finetune.lora_targets pattern 'transformer.h.7.attn.c_attn'" in err, err
    ours = ["plan", "--hardware", "h100", "--devices", "2", "--model", "tiny"]
    assert main([*ours, *lora, "--finetune.lora_targets=blocks.7.attn.wq"]) == 2
    err = capsys.readouterr().err
    assert "finetune.lora_targets pattern 'blocks.7.attn.wq'" in err, err


@pytest.mark.parametrize(
    "name", [n for n, c in _measured_cases()[2].items() if TP[0] in c["overrides"]]
)
def test_tp_traffic_formula_explain_and_a_measured_run_agree(runs, name):
    """LoRA under tp (and sp) sends what the formula and `explain` predict, byte for byte and
    call for call, on every rank, whatever linear is adapted first: a region operator whose
    input has no gradient runs no backward collective (the frozen embedding's exit, the first
    block's attention entry and, with no attention adapter, its exit and the MLP's entry), and
    only the adapters' gradients are summed over tp (A of a column-parallel linear, B of a
    row-parallel one, both of an MoE router's), not the frozen norms, biases or positions."""
    cases, results = runs
    cfg = load_config(None, cases[2][name]["overrides"])
    told = explain_record(cfg, 2, CPU)
    formula = told if _split_moe(cfg) else _planned(cfg, 2)
    for rank in results[2][name]:
        ran = rank["records"][-1]
        assert formula["comm_bytes"]["tp"] == told["comm_bytes"]["tp"] == ran["comm_bytes"]["tp"]
        assert formula["comm_calls"]["tp"] == told["comm_calls"]["tp"] == ran["comm_calls"]["tp"]
