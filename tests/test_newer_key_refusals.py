"""Bad values of the newer config keys (context and expert parallelism, FP8, compile, chunked
loss, head width, LoRA on experts, MoE balancing and capacity, blends, trackers, DCP
checkpoints) and impossible `plan` layouts: each is one ConfigError/DataError naming the
value and the fix, raised in-process before any process starts (no CLI spawned)."""

from __future__ import annotations

import pytest

from shardwise.config import load_config, split_overrides
from shardwise.errors import ShardwiseError
from shardwise.training.validate import derive

MOE = "--model.name=moe-tiny"
LORA = "--finetune.lora_rank=4"
BF16 = "--precision.compute=bf16"
ULYSSES = ["--parallel.cp=2", "--parallel.cp_mode=ulysses"]

CASES = [
    # (world, overrides, needles in the message)
    (1, ["--parallel.cp=two"], ["parallel.cp='two' is not an integer"]),
    (1, ["--parallel.cp=-2"], ["parallel.cp=-2 must be >= 1", "--parallel.cp=1"]),
    (1, ["--parallel.cp_mode=rings"], ["'rings' is not one of ring | ulysses"]),
    (1, ["--parallel.cp_mode=ulysses"], ["no effect with parallel.cp=1"]),
    (3, ["--parallel.cp=2"], ["world size 3 = pp(1) * dp * cp(2) * tp(1)", "3 / 2 = 1.5"]),
    (2, ["--parallel.cp=2", "--data.seq_len=127"], ["data.seq_len=127", "2 * cp = 4"]),
    (
        2,
        [*ULYSSES, "--model.n_heads=3", "--model.n_kv_heads=3", "--model.dim=48"],
        ["model.n_heads=3 is not divisible by 2", "--parallel.cp_mode=ring"],
    ),
    # the MoE decoder is ours, but its cp is not built: the message must not say otherwise
    (
        4,
        [MOE, "--parallel.cp=2", "--parallel.ep=2"],
        ["'moe-tiny' is an MoE decoder", "context parallelism is not built", "parallel.cp=1"],
    ),
    (1, [MOE, "--parallel.ep=0"], ["parallel.ep=0 must be >= 1"]),
    (2, ["--parallel.ep=2"], ["without routed experts", "--parallel.ep=1"]),
    (2, [MOE, "--parallel.ep=3"], ["must divide model.n_experts=4"]),
    (3, [MOE, "--parallel.ep=2", "--train.global_batch=12"], ["an ep dividing 3"]),
    (1, ["--precision.fp8=e4m3"], ["'e4m3' is not one of none | tensorwise | rowwise"]),
    (1, ["--precision.fp8=tensorwise"], ["precision.compute=fp32", "--precision.compute=bf16"]),
    (1, ["--precision.fp8=rowwise", "--precision.compute=fp16"], ["precision.compute=fp16"]),
    (1, [MOE, "--precision.fp8=rowwise", BF16], ["'moe-tiny' is an MoE decoder"]),
    (1, ["--precision.fp8=rowwise", BF16, LORA, "--finetune.base_quant=nf4"], ["base_quant"]),
    (1, ["--train.compile=true"], ["train.compile='true' is not one of false | blocks"]),
    (1, ["--train.compile=blocks", "--memory.recompute=selective"], ["recompute=full"]),
    (2, ["--train.compile=blocks", "--parallel.cp=2"], ["parallel.cp=2 attends"]),
    (1, ["--train.loss_chunks=-1"], ["train.loss_chunks=-1 must be >= 0"]),
    (1, ["--train.loss_chunks=2.5"], ["train.loss_chunks='2.5' is not an integer"]),
    (2, ["--train.loss_chunks=4", "--parallel.tp=2"], ["parallel.tp=2 splits the vocabulary"]),
    (1, ["--train.loss_chunks=4", "--model.name=hf-llama-tiny"], ["not ours to split"]),
    (1, ["--train.loss_chunks=4", "--precision.compute=fp16"], ["can overflow"]),
    (1, ["--train.loss_chunks=4", LORA, "--finetune.lora_targets=head"], ["adapter on 'head'"]),
    (1, ["--model.head_dim=-8"], ["model.head_dim=-8 must be positive"]),
    (1, ["--model.head_dim=15"], ["model.head_dim=15 is odd"]),
    (1, ["--model.head_dim=16", "--model.name=gpt2-tiny"], ["arch 'gpt2'", "head_dim=0"]),
    (
        2,
        ["--model.head_dim=16", "--model.n_heads=3", "--model.n_kv_heads=3", "--parallel.tp=2"],
        ["model.n_heads=3 (tiny) is not divisible by parallel.tp=2"],
    ),
    (1, [LORA, "--finetune.lora_targets=experts"], ["pattern 'experts' matches no linear"]),
    (1, [MOE, LORA, "--finetune.lora_targets=experts.w1"], ["'experts.w1' matches no linear"]),
    (
        2,
        [MOE, LORA, "--finetune.lora_targets=experts", "--parallel.tp=2", "--parallel.sp=true"],
        ["adapts stacked expert weights", "--parallel.tp=1"],
    ),
    # LoRA's keys without adapters would be ignored: refused
    (1, ["--finetune.lora_targets=wq"], ["finetune.lora_targets='wq'", "lora_rank=0"]),
    (1, ["--finetune.lora_alpha=32"], ["finetune.lora_alpha=32.0", "--finetune.lora_rank=16"]),
    (1, ["--finetune.lora_dropout=0.1"], ["finetune.lora_dropout=0.1", "lora_rank=0"]),
    (1, [MOE, "--train.moe_bias_balance=-0.1"], ["train.moe_bias_balance=-0.1 must be >= 0"]),
    (1, [MOE, "--train.moe_bias_balance=nan"], ["moe_bias_balance=nan is not a finite"]),
    (1, ["--train.moe_bias_balance=0.001"], ["model.name='tiny' has none"]),
    # names the one value that is wrong (it used to name n_shared_experts beside it)
    (1, [MOE, "--model.capacity_factor=-1"], ["error: model.capacity_factor=-1.0 must", "1.25"]),
    (1, [MOE, "--model.n_shared_experts=-2"], ["error: model.n_shared_experts=-2 must be"]),
    (1, [MOE, "--model.capacity_factor=inf"], ["capacity_factor=inf is not a finite"]),
    (1, ["--model.capacity_factor=1.25"], ["model.capacity_factor applies to mixture"]),
    (1, ["--log.backends=tensorbord"], ["did you mean 'tensorboard'"]),
    (1, ["--log.mlflow_uri=sqlite:///x.db"], ["has no mlflow"]),
    (1, ["--checkpoint.format=torch"], ["'torch' is not one of shardwise | dcp"]),
    (1, ["--parallel.c=2"], ["Did you mean 'parallel.cp'?"]),
    (1, ["--train.los_chunks=2"], ["Did you mean 'train.loss_chunks'?"]),
    (1, ["--precison.fp8=rowwise"], ["Did you mean 'precision.fp8'?"]),
    (1, ["--model.headdim=64"], ["Did you mean 'model.head_dim'?"]),
    (1, ["--data.blends=a:1"], ["Did you mean 'data.blend'?"]),
    (1, ["--log.backend=wandb"], ["Did you mean 'log.backends'?"]),
]


@pytest.mark.parametrize(("world", "overrides", "needles"), CASES)
def test_newer_keys_refuse_bad_values_naming_the_value_and_the_fix(world, overrides, needles):
    with pytest.raises(ShardwiseError) as err:
        derive(load_config(None, [*overrides, "--train.steps=2"]), world)
    text = f"error: {err.value}"  # as the CLI prints it
    assert "Fix:" in text or "Did you mean" in text or "is not" in text, text
    for needle in needles:
        assert needle in text, text


@pytest.mark.parametrize(
    ("blend", "needle"),
    [
        ("nodir:0.5,nodir2:0.5", "data.blend source 'nodir' does not exist"),
        ("a:x", "data.blend weight 'x' of 'a' must be a number > 0"),
        ("a:-1,b:2", "data.blend weight '-1'"),
        ("a", "data.blend entry 'a' is not PATH:WEIGHT"),
    ],
)
def test_bad_blends_are_refused_with_the_entry(blend, needle, tmp_path, monkeypatch):
    from shardwise.data import data_spec, prepare_data

    monkeypatch.chdir(tmp_path)  # the relative names exist nowhere
    cfg = load_config(None, [f"--data.blend={blend}"])
    with pytest.raises(ShardwiseError, match="Fix:") as err:
        prepare_data(data_spec(cfg, 512))
    assert needle in str(err.value), err.value


def test_a_blend_beside_a_dataset_is_refused():
    from shardwise.data import data_spec, prepare_data

    cfg = load_config(None, ["--data.blend=a:1", "--data.dataset=corpus.txt"])
    with pytest.raises(ShardwiseError, match="both name the training data"):
        prepare_data(data_spec(cfg, 512))


PLAN = ["--hardware=h100", "--devices", "8", "--model"]


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        # a pinned degree no layout has is the pin's fault, not "no layout fits" (memory)
        (
            [*PLAN, "tiny", "--parallel.cp=3"],
            ["no valid layout on 8 x h100", "no layout with parallel.cp=3", "leave parallel.cp"],
        ),
        (
            [*PLAN, "moe-tiny", "--parallel.ep=3"],
            ["no layout with parallel.ep=3", "of model.n_experts=4"],
        ),
        ([*PLAN, "tiny", "--train.loss_chunks=-3"], ["train.loss_chunks=-3 must be >= 0"]),
        ([*PLAN, "tiny", "--finetune.lora_targets=wq"], ["finetune.lora_rank=0 adds none"]),
        ([*PLAN, "tiny", "--parallel.ep=2"], ["parallel.ep=2", "only with routed experts"]),
        # tp=4 on 6 devices: a train --nproc 6 that would refuse it
        (
            ["--hardware=h100", "--devices", "6", "--model", "tiny", "--parallel.tp=4"],
            ["the layouts with parallel.tp=4 were refused", "tp*pp*cp does not divide"],
        ),
        ([*PLAN, "tiny", "--train.compil=blocks"], ["Did you mean 'train.compile'?"]),
        (["--hardware=h1000", "--devices", "8", "--model", "tiny"], ["unknown hardware"]),
    ],
)
def test_plan_refuses_impossible_layouts_by_name(argv, needles):
    from shardwise.cli.plan import run

    with pytest.raises(ShardwiseError) as err:
        run(*split_overrides(argv))
    text = str(err.value)
    assert "no layout of" not in text, text  # the memory message would misdiagnose these
    for needle in needles:
        assert needle in text, text


def test_an_export_inside_the_run_suggests_an_out_outside_every_protected_folder(tmp_path):
    """OUT inside checkpoint.dir, itself inside the run: the suggested OUT is beside the run
    (a suggestion beside checkpoint.dir would be inside the run, refused in turn)."""
    from shardwise.checkpoint.export_dir import _refuse_overlap

    run = tmp_path / "run"
    protected = {
        "the checkpoint": run / "checkpoints" / "step-00000002",
        "the checkpoint.dir": run / "checkpoints",
        "the run directory": run,
    }
    with pytest.raises(ShardwiseError) as err:
        _refuse_overlap(run / "checkpoints" / "x", protected, "dcp")
    text = str(err.value)
    assert f"is inside the checkpoint.dir {run / 'checkpoints'}" in text, text
    assert f"e.g. {run.resolve()}-dcp." in text, text
    _refuse_overlap(run.resolve().parent / "run-dcp", protected, "dcp")  # that one is accepted


def _source(tmp_path, *overrides: str):
    """What export reads of a run (checkpoint/export_source.Source), without training one."""
    from types import SimpleNamespace

    from shardwise.models.spec import spec_from_config

    cfg = load_config(None, list(overrides))
    return SimpleNamespace(cfg=cfg, spec=spec_from_config(cfg), given=tmp_path / "run")


def test_hf_export_of_a_family_without_a_transformers_class_is_refused(tmp_path, monkeypatch):
    """A ResNet run: one message naming the family and --format dcp, not a KeyError, and
    OUT is never created."""
    import contextlib

    from shardwise.checkpoint import export
    from shardwise.checkpoint.export import check_hf_class

    src = _source(tmp_path, "--model.name=resnet18", "--data.dataset=digits")
    src.index, src.path = {}, tmp_path / "run" / "checkpoints" / "step-00000001"
    monkeypatch.setattr(export, "open_source", lambda *a: contextlib.nullcontext(src))
    with pytest.raises(ShardwiseError) as err:
        export.export_hf(tmp_path / "run", tmp_path / "out")
    assert "model.name='resnet18', a ResNet" in str(err.value), err.value
    assert "Fix: --format dcp" in str(err.value), err.value
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no OUT, lock or temporary
    check_hf_class(_source(tmp_path, "--model.name=tiny").spec, "unused")  # a decoder exports


def test_hf_export_of_a_model_dcp_of_such_a_family_is_refused_before_out(
    tmp_path, monkeypatch, capsys
):
    """A model DCP given a ResNet's shape: the config refuses it (model.init_from takes our
    decoders only); should a shape of such a family reach the export, its own check refuses it
    with the run's wording, before the tensors are named and before OUT exists."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from shardwise.checkpoint import export_model as em
    from shardwise.cli.main import main
    from shardwise.models.spec import spec_from_config

    source, out = tmp_path / "dcp", tmp_path / "out"
    with warnings.catch_warnings():  # torch warns that it assumes one process: it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"embed.weight": torch.zeros(4, 2)}, checkpoint_id=source, no_dist=True)
    given = sorted(p.name for p in tmp_path.iterdir())
    assert main(["export", str(source), "--format", "hf", str(out), "--model.name=resnet18"]) == 2
    assert "model.name='resnet18' is a ResNet" in capsys.readouterr().err
    resnet = spec_from_config(load_config(None, ["--model.name=resnet18"]))
    monkeypatch.setattr(em, "dcp_spec", lambda path, overrides: resnet)
    with pytest.raises(ShardwiseError) as err:  # (before: a KeyError naming the tensors)
        em.export_model_dcp(source, out, ["--model.name=resnet18"])
    assert f"'{source}' read as resnet18 is a ResNet, and --format hf" in str(err.value)
    assert "Fix: --model.name of a Llama-style or GPT-2 decoder" in str(err.value), err.value
    assert sorted(p.name for p in tmp_path.iterdir()) == given  # no OUT, lock or temporary


def test_peft_export_of_a_run_without_adapters_points_to_whole_model_formats(tmp_path, monkeypatch):
    import contextlib

    from shardwise.checkpoint import export_peft as ep

    pytest.importorskip("peft")
    src = _source(tmp_path, "--model.name=resnet18", "--data.dataset=digits")
    monkeypatch.setattr(ep, "open_source", lambda *a: contextlib.nullcontext(src))
    with pytest.raises(ShardwiseError) as err:
        ep.export_peft(tmp_path / "run", tmp_path / "out")
    assert "trained no LoRA adapter" in str(err.value), err.value
    assert "Fix: --format dcp exports its whole model" in str(err.value), err.value
    assert not (tmp_path / "out").exists()


def test_plan_offers_only_layouts_that_use_every_device(capsys):
    """6 devices: tp=4 would leave 2 idle, and `train --nproc 6 --parallel.tp=4` refuses it."""
    import json

    from shardwise.cli.plan import run

    argv = ["--hardware=h100", "--devices", "6", "--model", "tiny", "--json", "--top", "100000"]
    assert run(*split_overrides([*argv, "--train.global_batch=12"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["candidates"] and out["rejected"]["tp*pp*cp does not divide the devices"] > 0
    for rec in out["candidates"]:
        assert rec["tp"] * rec["pp"] * rec["cp"] * rec["dp"] == 6, rec
