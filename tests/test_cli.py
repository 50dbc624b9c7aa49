"""End to end: the real `shardwise` CLI in subprocesses on a tiny model, asserting on the files
it writes (metrics.jsonl contract of docs/design.md, config.json, TensorBoard events), launcher
invariance under an external torchrun, and `explain` / help output."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.config import all_keys, config_from_dict, load_config

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
SHARDWISE = str(BIN / "shardwise")
TORCHRUN = str(BIN / "torchrun")

STEPS = 6
TINY = [
    "--model.n_layers=2",
    "--data.seq_len=32",
    "--train.global_batch=8",
    f"--train.steps={STEPS}",
    "--train.eval_every=3",
    "--train.eval_batches=2",
    "--log.every=1",
    "--log.progress=off",
    "--run.device=cpu",  # gloo on every machine: two ranks cannot share one GPU under NCCL
]
CONTRACT = ["step", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s"]
CONTRACT += ["mem_bytes", "comm_bytes", "comm_calls", "comm_wait_s"]
MEM_KEYS = {"params", "grads", "master", "optimizer", "activations", "buffers", "total"}
COMM_KEYS = {"dp", "tp", "pp"}


def _env() -> dict[str, str]:
    """This environment minus any launcher's, so the CLI starts its own ranks."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("SLURM")}
    env.setdefault("SHARDWISE_CACHE", os.path.expanduser("~/.cache/shardwise"))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    env = {**_env(), **env}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`shardwise train --nproc 2`: the CLI spawns its two ranks itself (with a temporary
    directory of its own: nothing may be left in it, see below)."""
    run_dir = tmp_path_factory.mktemp("local") / "run"
    scratch = run_dir.parent / "tmp"
    scratch.mkdir()
    cmd = [SHARDWISE, "train", "--nproc", "2", *TINY, f"--run.dir={run_dir}"]
    proc = _run(cmd, TMPDIR=str(scratch))
    return run_dir, proc.stdout


def test_a_local_launch_leaves_nothing_in_the_temporary_directory(local_run) -> None:
    """torch elastic makes a folder for its ranks' error files per launch and never removes
    it: a user's /tmp would fill with one per job. The launcher removes it, and the ranks'
    forkserver its socket. (torch's compile cache, which importing TorchDynamo creates there
    and every torch process shares, is not the launch's.)"""
    run_dir, _ = local_run
    left = [p.name for p in (run_dir.parent / "tmp").iterdir()]
    assert [name for name in left if not name.startswith("torchinductor_")] == []


def test_train_prints_the_plan_and_one_line_per_step(local_run: tuple[Path, str]) -> None:
    _, stdout = local_run
    lines = stdout.splitlines()
    plans = [line for line in lines if line.startswith("shardwise: tiny (")]
    assert len(plans) == 1, stdout
    assert "on 2 rank(s): pp=1 dp=2 tp=1 zero=0" in plans[0]
    assert "global batch 8 = 4 x 1 micro x 2 dp" in plans[0]
    assert "256 tokens/step" in plans[0] and "predicted memory/rank" in plans[0]
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(" | ")[0] for s in steps] == [f"step {i}/{STEPS}" for i in range(1, 7)]
    assert all("| loss " in s and "tok/s" in s for s in steps)
    assert [("| eval " in s) for s in steps] == [False, False, True, False, False, True]


def test_metrics_jsonl_follows_the_contract(local_run: tuple[Path, str]) -> None:
    run_dir, _ = local_run
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert set(CONTRACT) <= set(r), sorted(set(CONTRACT) - set(r))
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 20
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["lr"] > 0 and r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert r["tokens"] == 8 * 32 * r["step"]
        mem, comm = r["mem_bytes"], r["comm_bytes"]
        assert set(mem) >= MEM_KEYS, sorted(MEM_KEYS - set(mem))
        assert all(isinstance(mem[k], int) and mem[k] >= 0 for k in MEM_KEYS)
        assert mem["params"] > 0 and mem["grads"] == mem["params"]  # fp32 compute and reduce
        assert mem["master"] == 0 and mem["optimizer"] >= 2 * mem["params"]
        state = sum(mem[k] for k in ("params", "grads", "master", "optimizer", "buffers"))
        assert state <= mem["total"] <= state + mem["activations"]
        assert set(comm) == COMM_KEYS
        # all-reduce of S gradient bytes over 2 ranks: 2(n-1)/n*S = S per rank
        assert comm["dp"] == mem["grads"] and comm["tp"] == 0 and comm["pp"] == 0
        # the tiny model's gradients fit one 25 MB bucket: one all-reduce per step
        assert r["comm_calls"] == {"dp": 1, "tp": 0, "pp": 0}
        wait = r["comm_wait_s"]
        assert set(wait) == COMM_KEYS and wait["tp"] == wait["pp"] == 0
        assert 0 < wait["dp"] < r["step_time_s"]  # the gradient and loss all-reduces
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert all(math.isfinite(r["eval_loss"]) for r in records if "eval_loss" in r)
    assert records[-1]["loss"] < records[0]["loss"]


def test_config_json_round_trips(local_run: tuple[Path, str]) -> None:
    run_dir, _ = local_run
    saved = config_from_dict(json.loads((run_dir / "config.json").read_text()))
    assert saved == load_config(None, [*TINY, f"--run.dir={run_dir}"])


def test_tensorboard_has_the_loss_curve(local_run: tuple[Path, str]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = local_run
    events = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1  # only rank 0 writes
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    records = _records(run_dir)
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert [e.step for e in acc.Scalars("train/eval_loss")] == [3, 6]


def test_external_torchrun_gives_the_same_losses(
    local_run: tuple[Path, str], tmp_path: Path
) -> None:
    """Launcher invariance: torchrun's ranks join instead of the CLI spawning its own."""
    run_dir = tmp_path / "run"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "shardwise.cli.main"]
    proc = _run([*cmd, "train", *TINY, f"--run.dir={run_dir}"])
    assert proc.stdout.count(" rank(s): pp=1 dp=2 tp=1") == 1, proc.stdout  # the plan, once
    ours, theirs = _records(local_run[0]), _records(run_dir)
    assert [r["step"] for r in theirs] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [r[key] for r in theirs] == pytest.approx([r[key] for r in ours], rel=1e-6), key
    evals = {r["step"]: r["eval_loss"] for r in ours if "eval_loss" in r}
    assert {r["step"]: r["eval_loss"] for r in theirs if "eval_loss" in r} == pytest.approx(
        evals, rel=1e-6
    )


EXPLAIN = ["--nproc", "2", "--model.n_layers=3", "--model.dim=96", "--train.micro_batch=4"]


@pytest.fixture(scope="module")
def explain_json() -> dict:
    proc = _run([SHARDWISE, "explain", *EXPLAIN, "--json"], timeout=120)
    return json.loads(proc.stdout)


def test_explain_json(explain_json: dict) -> None:
    r = explain_json
    assert (r["world"], r["pp"], r["dp"], r["tp"], r["zero"]) == (2, 1, 2, 1, 0)
    assert (r["n_layers"], r["dim"]) == (3, 96)
    assert r["params"] > 0 and isinstance(r["params"], int)
    assert (r["global_batch"], r["micro_batch"], r["micro_batches_per_step"]) == (16, 4, 2)
    assert r["tokens_per_step"] == 16 * 128
    assert set(r["mem_bytes"]) >= MEM_KEYS
    assert all(isinstance(v, int) and v >= 0 for v in r["mem_bytes"].values())
    assert r["mem_bytes"]["params"] == 4 * r["params"]  # fp32


def _plain_explain(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["explain", *EXPLAIN]) == 0
    return capsys.readouterr().out


def test_explain_plain_prints_the_derived_values(
    explain_json: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    r, out = explain_json, _plain_explain(capsys)
    for expected in (
        f"pp={r['pp']} x dp={r['dp']} x tp={r['tp']}",
        f"{r['model']} ({r['arch']})",
        f"{r['params']:,}",
        f"{r['tokens_per_step']:,}",
        f"{r['precision']} / {r['reduce']}",
    ):
        assert expected in out, expected
    head = out.split("memory per rank:")[0].splitlines()
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in head)
    assert rows["world size"] == str(r["world"])
    assert rows["zero stage"] == str(r["zero"])
    assert rows["global batch"] == str(r["global_batch"])
    assert rows["micro batch"] == str(r["micro_batch"])
    assert rows["micro-batches per step (accumulation)"] == str(r["micro_batches_per_step"])
    assert rows["recompute"] == r["recompute"]
    assert rows["layers / hidden size"] == f"{r['n_layers']} / {r['dim']}"
    assert "dp traffic per step/rank" in rows
    for key, value in r["mem_bytes"].items():
        assert any(
            line.split()[:1] == [key] and f"({value:,} B)" in line for line in out.splitlines()
        )


def test_explain_plain_shows_every_json_value(
    explain_json: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _plain_explain(capsys)
    words = set(out.replace("(", " ").replace(")", " ").replace("=", " ").split())
    for key, value in explain_json.items():
        if isinstance(value, float):  # rounded for reading: 4 digits, whole tokens, a percent
            forms = {f"{value:.4g}", f"{value:,.0f}", f"{100 * value:.1f}%"}
            assert forms & words, (key, value)
        elif not isinstance(value, dict):  # mem_bytes and comm_bytes are checked above
            shown = f"{value:,}" if isinstance(value, int) else str(value)
            in_text = isinstance(value, str) and " " in value and value in out  # a sentence
            assert str(value) in words or shown in words or in_text, (key, value)


def test_help_and_help_config() -> None:
    proc = _run([SHARDWISE, "--help"], timeout=60)
    assert proc.stdout.startswith(
        "usage: shardwise {train,explain,profile,plan,launch,export,data}"
    )
    assert "--help-config" in proc.stdout and "--nproc" in proc.stdout
    proc = _run([SHARDWISE, "train", "--help-config"], timeout=60)
    for key in all_keys():
        assert f"| `{key}` |" in proc.stdout, key


def test_help_config_works_where_help_says() -> None:
    """`shardwise --help` lists `--help-config` at the top level; there it prints the config
    reference (it used to answer "unknown command '--help-config'")."""
    from shardwise.cli.main import USAGE

    assert "--help-config" in USAGE
    proc = _run([SHARDWISE, "--help-config"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    for key in all_keys():
        assert f"| `{key}` |" in proc.stdout, key


def _parsers():
    from shardwise.cli import export, launch, main, plan

    return {
        "train": main.parser("train"),
        "explain": main.parser("explain"),
        "plan": plan.parser(),
        "launch": launch._parser(),
        "export": export._parser(),
    }


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("command", ["train", "explain", "plan", "launch", "export"])
def test_every_option_is_described_in_its_commands_help(command, capsys) -> None:
    """`shardwise COMMAND -h` prints every option of the parser that reads the command line,
    each with a one-line description (the help is generated from that parser, so it cannot
    list an option the command does not take, or miss one it does)."""
    from shardwise.cli.main import main

    parser = _parsers()[command]
    args = ["launch", "--help"] if command == "launch" else [command, "-h"]
    assert main(args) == 0
    shown = _flat(capsys.readouterr().out)
    assert shown.startswith(f"usage: shardwise {command}")
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{command}: {action.dest} has no help"
        assert _flat(action.help % {"default": action.default}) in shown, (command, action.dest)
        for flag in action.option_strings:
            assert flag in shown, (command, flag)


def test_plan_applies_model_overrides_to_a_named_model_in_either_order(capsys) -> None:
    import dataclasses

    from shardwise.cli.main import main
    from shardwise.models.presets import preset
    from shardwise.plan.shapes import param_count

    three = param_count(dataclasses.replace(preset("gpt2-125m"), n_layers=3))
    base = ["plan", "--devices", "2", "--hardware", "h100", "--top", "1"]
    for args in (
        [*base, "--model", "gpt2-125m", "--model.n_layers=3"],
        [*base, "--model.n_layers=3", "--model", "gpt2-125m"],
    ):
        assert main(args) == 0
        header = capsys.readouterr().out.splitlines()[0]
        assert header.startswith(f"plan: {three / 1e6:,.1f}M params, 3 layers x 768"), header


def test_a_wider_preset_keeps_its_mlp_ratio_and_explain_rounds(capsys) -> None:
    from shardwise.cli.main import main
    from shardwise.config import load_config
    from shardwise.training.validate import model_spec

    for name, ratio in (("gpt2-tiny", 4), ("tiny", 352 / 128)):
        spec = model_spec(load_config(None, [f"--model.name={name}", "--model.dim=256"]))
        assert spec.ffn_dim == ratio * 256, (name, spec.ffn_dim)
    pinned = load_config(None, ["--model.name=gpt2-tiny", "--model.dim=256", "--model.ffn_dim=300"])
    assert model_spec(pinned).ffn_dim == 300  # a given width is kept
    assert main(["explain", "--model.name=tiny", "--nproc", "1"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("predicted step time"))
    assert len(line.split()[-1]) <= 7, line  # 4 significant digits, not 16
    assert next(x for x in out.splitlines() if x.startswith("predicted mfu")).endswith("%")
