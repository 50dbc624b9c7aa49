"""shardwise.config: TOML + overrides (later wins), typed parsing, did-you-mean, help strings,
the generated reference, round trips, and the frozen CLI surface (STYLE.md rule 7)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest

from shardwise.cli.main import main
from shardwise.config import (
    Config,
    all_keys,
    config_from_dict,
    field_types,
    load_config,
    parse_overrides,
    reference_markdown,
    sections,
)
from shardwise.errors import ConfigError

# Every config key, in declaration order. Changing this list is a deliberate act: a new knob
# goes into the dataclass tree (with a help string), then here (STYLE.md rule 7).
GOLDEN_KEYS = [
    "model.name",
    "model.task",
    "model.n_layers",
    "model.dim",
    "model.n_heads",
    "model.n_kv_heads",
    "model.head_dim",
    "model.ffn_dim",
    "model.vocab_size",
    "model.tie_embeddings",
    "model.max_seq_len",
    "model.dropout",
    "model.attn_dropout",
    "model.init_from",
    "model.sync_batchnorm",
    "model.n_experts",
    "model.top_k",
    "model.n_shared_experts",
    "model.moe_every",
    "model.router",
    "model.capacity_factor",
    "data.dataset",
    "data.seq_len",
    "data.text_field",
    "data.label_field",
    "data.format",
    "data.prompt_field",
    "data.input_field",
    "data.response_field",
    "data.messages_field",
    "data.pack",
    "data.tokenizer",
    "data.max_bad_rows",
    "data.prefetch",
    "data.val_fraction",
    "data.image_size",
    "data.cache_dir",
    "data.blend",
    "train.steps",
    "train.global_batch",
    "train.micro_batch",
    "train.lr",
    "train.seed",
    "train.eval_every",
    "train.eval_batches",
    "train.freeze",
    "train.loss",
    "train.compile",
    "train.loss_chunks",
    "train.max_skipped_steps",
    "train.moe_aux_loss",
    "train.moe_bias_balance",
    "optim.name",
    "optim.beta1",
    "optim.beta2",
    "optim.eps",
    "optim.weight_decay",
    "optim.grad_clip",
    "optim.warmup_steps",
    "optim.schedule",
    "optim.min_lr_ratio",
    "finetune.lora_rank",
    "finetune.lora_alpha",
    "finetune.lora_dropout",
    "finetune.lora_targets",
    "finetune.base_quant",
    "parallel.tp",
    "parallel.pp",
    "parallel.zero",
    "parallel.sp",
    "parallel.pp_schedule",
    "parallel.pp_virtual",
    "parallel.pp_split",
    "parallel.cp",
    "parallel.cp_mode",
    "parallel.ep",
    "parallel.bucket_mb",
    "parallel.timeout_s",
    "parallel.grad_compression",
    "parallel.powersgd_rank",
    "parallel.powersgd_warm_start",
    "precision.compute",
    "precision.reduce",
    "precision.loss_scale",
    "precision.scale_window",
    "precision.fp8",
    "memory.recompute",
    "memory.offload",
    "memory.nvme_dir",
    "memory.nvme_buffer_mb",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.dir",
    "checkpoint.resume",
    "checkpoint.on_signal",
    "checkpoint.async",
    "checkpoint.per_rank_state",
    "checkpoint.format",
    "log.every",
    "log.tensorboard",
    "log.backends",
    "log.project",
    "log.mlflow_uri",
    "log.progress",
    "log.ledger",
    "profile.steps",
    "profile.warmup",
    "profile.max_events",
    "profile.host_syncs",
    "run.dir",
    "run.device",
    "run.cpu_affinity",
]

# Keys docs/design.md names as a contract other tools rely on: they must never disappear.
CONTRACT_KEYS = [
    "model.name",
    "model.n_layers",
    "model.dim",
    "model.n_heads",
    "model.n_kv_heads",
    "model.ffn_dim",
    "model.vocab_size",
    "model.tie_embeddings",
    "data.dataset",
    "data.seq_len",
    "train.steps",
    "train.global_batch",
    "train.micro_batch",
    "train.lr",
    "train.seed",
    "parallel.tp",
    "parallel.pp",
    "parallel.zero",
    "parallel.sp",
    "parallel.pp_schedule",
    "parallel.pp_virtual",
    "precision.compute",
    "precision.reduce",
    "memory.recompute",
    "memory.offload",
    "run.dir",
]


def _fields():
    for section, typ in sections().items():
        hints = field_types(typ)
        for f in dataclasses.fields(typ):
            yield section, f, hints[f.name]


def _cli(value: object) -> str:
    """A value as a user types it on the command line."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


# --- the frozen surface ----------------------------------------------------------------------


def test_cli_surface_is_frozen() -> None:
    added = sorted(set(all_keys()) - set(GOLDEN_KEYS))
    removed = sorted(set(GOLDEN_KEYS) - set(all_keys()))
    assert not added and not removed, (
        f"config keys changed: added {added}, removed {removed}. New knobs go into the "
        "dataclass tree with a help string and then into GOLDEN_KEYS, deliberately."
    )
    assert all_keys() == GOLDEN_KEYS  # the order is the reference's order too


def test_design_contract_keys_exist() -> None:
    assert set(CONTRACT_KEYS) <= set(all_keys())


def test_every_field_has_help_a_default_and_a_parseable_type() -> None:
    for section, f, typ in _fields():
        key = f"{section}.{f.name}"
        help_text = f.metadata.get("help", "")
        assert isinstance(help_text, str) and help_text.strip(), f"{key} has no help string"
        assert f.default is not dataclasses.MISSING, f"{key} has no default"
        if get_origin(typ) is Literal:
            assert f.default in get_args(typ), f"{key} default not among its choices"
        else:
            assert typ in (int, float, bool, str), f"{key} has unsupported type {typ}"
            assert type(f.default) is typ, f"{key} default {f.default!r} is not a {typ}"


def test_reference_markdown_lists_every_key_with_its_help() -> None:
    ref = reference_markdown()
    lines = ref.splitlines()
    assert lines[:2] == ["| key | default | meaning |", "|---|---|---|"]
    rows = lines[2:]
    assert [row.split("`")[1] for row in rows] == all_keys()
    for row, (_, f, _) in zip(rows, _fields(), strict=True):
        assert f.metadata["help"] in row
    assert '| `model.name` | `"tiny"` |' in ref
    assert "| `log.tensorboard` | `true` |" in ref
    assert "| `train.steps` | `200` |" in ref


# --- loading -----------------------------------------------------------------------------------


def test_no_file_no_overrides_gives_defaults() -> None:
    assert load_config() == Config()
    assert load_config(None, []) == Config()


def test_toml_sets_every_kind_of_value(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        """
        [model]
        name = "gpt2-tiny"
        n_layers = 2
        [data]
        seq_len = 64
        dataset = "corpus/*.txt"
        [train]
        steps = 1_000
        lr = 1e-3
        global_batch = 32.0   # an integral float is an int
        [optim]
        weight_decay = 0      # an int is a float
        [parallel]
        sp = false
        [precision]
        compute = "bf16"
        [log]
        tensorboard = "off"
        """,
    )
    cfg = load_config(path)
    assert cfg.model.name == "gpt2-tiny" and cfg.model.n_layers == 2
    assert cfg.data.seq_len == 64 and cfg.data.dataset == "corpus/*.txt"
    assert cfg.train.steps == 1000 and type(cfg.train.steps) is int
    assert cfg.train.lr == 1e-3
    assert cfg.train.global_batch == 32 and type(cfg.train.global_batch) is int
    assert cfg.optim.weight_decay == 0.0 and type(cfg.optim.weight_decay) is float
    assert cfg.parallel.sp is False
    assert cfg.precision.compute == "bf16"
    assert cfg.log.tensorboard is False
    untouched = Config()
    assert cfg.memory == untouched.memory and cfg.run == untouched.run


def test_override_forms_equals_and_space() -> None:
    args = ["--train.steps=7", "--train.lr", "0.5", "--run.dir=out=dir", "--data.dataset", "a b"]
    assert parse_overrides(args) == [
        ("train.steps", "7"),
        ("train.lr", "0.5"),
        ("run.dir", "out=dir"),  # only the first '=' splits
        ("data.dataset", "a b"),
    ]
    cfg = load_config(None, args)
    assert cfg.train.steps == 7 and cfg.train.lr == 0.5
    assert cfg.run.dir == "out=dir" and cfg.data.dataset == "a b"


@pytest.mark.parametrize(
    "argv",
    [
        ["--train.global_batch", "32", "--nproc", "2", "--json"],
        ["--nproc", "2", "--train.global_batch", "32", "--json"],
    ],
)
def test_space_form_through_the_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", *argv]) == 0, capsys.readouterr().err
    record = json.loads(capsys.readouterr().out)
    assert record["global_batch"] == 32 and record["world"] == 2


def test_space_form_after_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _toml(tmp_path, "[train]\nglobal_batch = 8\n")
    assert main(["explain", str(path), "--train.global_batch", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["global_batch"] == 32


def test_empty_value_is_a_value() -> None:
    assert load_config(None, ["--data.cache_dir="]).data.cache_dir == ""
    assert load_config(None, ["--data.cache_dir", ""]).data.cache_dir == ""


def test_later_wins(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[train]\nsteps = 5\nseed = 3\n[model]\nname = 'gpt2-tiny'\n")
    assert load_config(path).train.steps == 5
    cfg = load_config(path, ["--train.steps=6", "--model.name", "tiny", "--train.steps", "7"])
    assert cfg.train.steps == 7  # the last override
    assert cfg.model.name == "tiny"  # an override beats the file
    assert cfg.train.seed == 3  # the file beats the default


def test_every_default_survives_the_command_line() -> None:
    """Each key accepts its own default written as a user would type it."""
    overrides = [f"--{key}={_cli(value)}" for key, value in _flat(Config()).items()]
    assert load_config(None, overrides) == Config()


# --- typed parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [
        ("train.steps", "12", 12),
        ("train.steps", "1_000", 1000),
        ("train.seed", "-3", -3),
        ("train.lr", "3e-4", 3e-4),
        ("train.lr", "1", 1.0),
        ("parallel.bucket_mb", "0.5", 0.5),
        ("parallel.sp", "true", True),
        ("parallel.sp", "TRUE", True),
        ("parallel.sp", "yes", True),
        ("parallel.sp", "on", True),
        ("parallel.sp", "1", True),
        ("parallel.sp", "false", False),
        ("parallel.sp", "No", False),
        ("parallel.sp", "off", False),
        ("parallel.sp", "0", False),
        ("precision.compute", "bf16", "bf16"),
        ("memory.recompute", "selective", "selective"),
        ("memory.offload", "optimizer+params", "optimizer+params"),
        ("parallel.pp_schedule", "interleaved", "interleaved"),
        ("run.device", "cpu", "cpu"),
        ("data.dataset", "some/dir/*.jsonl", "some/dir/*.jsonl"),
    ],
)
def test_values_are_parsed_by_field_type(key: str, raw: str, expected: object) -> None:
    section, name = key.split(".")
    value = getattr(getattr(load_config(None, [f"--{key}={raw}"]), section), name)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("key", "raw", "says"),
    [
        ("train.steps", "abc", "is not an integer"),
        ("train.steps", "1.5", "is not an integer"),
        ("train.lr", "fast", "is not a number"),
        ("parallel.sp", "maybe", "is not a boolean"),
        ("precision.compute", "fp64", "is not one of fp32 | bf16 | fp16"),
        ("optim.schedule", "Cosine", "is not one of cosine | constant"),
    ],
)
def test_wrong_types_name_key_value_and_fix(key: str, raw: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"--{key}={raw}"])
    msg = str(info.value)
    assert f"{key}='{raw}'" in msg and says in msg
    assert "Fix" in msg and f"--{key}=" in msg


@pytest.mark.parametrize(
    ("toml", "key", "says"),
    [
        ("[train]\nsteps = true", "train.steps", "is not an integer"),
        ("[train]\nsteps = 2.5", "train.steps", "is not an integer"),
        ('[train]\nsteps = "ten"', "train.steps", "is not an integer"),
        ("[train]\nlr = true", "train.lr", "is not a number"),
        ("[data]\ndataset = 5", "data.dataset", "must be a string"),
        ("[precision]\ncompute = 16", "precision.compute", "is not one of"),
    ],
)
def test_wrong_toml_types_are_rejected(tmp_path: Path, toml: str, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, toml))
    msg = str(info.value)
    assert msg.startswith(f"{key}=") and says in msg and "Fix" in msg


def test_toml_boolean_for_tie_embeddings(tmp_path: Path) -> None:
    cfg = load_config(_toml(tmp_path, "[model]\ntie_embeddings = true\n"))
    assert str(cfg.model.tie_embeddings).lower() == "true"


# --- unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("train.stepz", "train.steps"),
        ("trian.steps", "train.steps"),
        ("parallel.zer0", "parallel.zero"),
        ("model.nlayers", "model.n_layers"),
        ("precision.computes", "precision.compute"),
        ("data.seqlen", "data.seq_len"),
    ],
)
def test_unknown_key_suggests_the_closest(typo: str, meant: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"--{typo}=1"])
    msg = str(info.value)
    assert f"unknown config key '{typo}'" in msg
    assert f"Did you mean '{meant}'?" in msg
    assert "--help-config" in msg


def test_unknown_key_without_a_close_match_points_at_the_reference() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--foo.bar=1"])
    msg = str(info.value)
    assert "'foo.bar'" in msg and "Did you mean" not in msg and "--help-config" in msg


def test_unknown_toml_section_suggests_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'training\.steps'.*Did you mean 'train\.steps'"):
        load_config(_toml(tmp_path, "[training]\nsteps = 1\n"))


def test_override_needs_a_value_and_a_section() -> None:
    with pytest.raises(ConfigError, match=r"'--train\.steps' has no value\. Fix: --train\.steps="):
        parse_overrides(["--train.steps"])
    for bad in (["steps=3"], ["--steps=3"], ["-train.steps=3"]):
        with pytest.raises(ConfigError, match=r"Overrides look like --section\.key=value"):
            parse_overrides(bad)


# --- round trips --------------------------------------------------------------------------------


def _flat(cfg: Config) -> dict[str, object]:
    return {f"{s}.{k}": v for s, fields in cfg.to_dict().items() for k, v in fields.items()}


def test_to_dict_has_every_key_and_round_trips() -> None:
    cfg = load_config(
        None,
        [
            "--model.name=gpt2-tiny",
            "--model.tie_embeddings=false",
            "--data.seq_len=64",
            "--train.lr=0.01",
            "--parallel.sp=true",
            "--precision.compute=bf16",
            "--memory.recompute=full",
            "--log.tensorboard=false",
            "--run.dir=runs/x",
        ],
    )
    assert list(_flat(cfg)) == all_keys()
    assert config_from_dict(cfg.to_dict()) == cfg
    # as the run's config.json stores it
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert config_from_dict(Config().to_dict()) == Config()


def test_config_from_dict_rejects_unknown_keys() -> None:
    values = Config().to_dict()
    values["train"]["stepz"] = 3
    with pytest.raises(ConfigError, match=r"Did you mean 'train\.steps'"):
        config_from_dict(values)
