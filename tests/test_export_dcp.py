"""`shardwise export --format dcp` writes a PyTorch distributed checkpoint that a plain model
loads with `torch.distributed.checkpoint.load`, holding exactly the weights the run ended with.

The reference is the run's own final parameters (as the training process holds them), not
our checkpoint reader, so a wrong name, a missed tied weight or a wrong LoRA merge shows.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardwise.checkpoint.export_source import open_source
from shardwise.cli.main import main
from shardwise.launchers.harness import run_here
from shardwise.models import build_model
from support.compare import case

pytestmark = pytest.mark.slow

RUN = ["--model.n_layers=2", "--train.steps=3", "--checkpoint.every=3"]
LORA = ["--finetune.lora_rank=4", "--finetune.lora_alpha=8"]


def _trained(tmp: Path, *overrides: str) -> tuple[Path, dict]:
    run_dir = tmp / "run"
    result = run_here(case(*RUN, *overrides), str(run_dir))
    assert len(result["losses"]) == 3
    return run_dir, result


def _load_plain(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """A plain model of the run's family (its recorded spec: the vocabulary comes from the
    data), its state dict filled by `dcp.load` alone."""
    with open_source(run_dir) as src:
        model = build_model(src.spec)
    state = model.state_dict()
    for t in state.values():
        t.zero_()  # nothing of the built model's own init may pass for a loaded value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(state, checkpoint_id=str(out), no_dist=True)
    model.load_state_dict(state)
    return dict(model.named_parameters(remove_duplicate=False))


def test_dcp_export_loads_into_a_plain_model(tmp_path: Path) -> None:
    """Every parameter equals the run's final value bit for bit (the export reads the fp32
    values the run saved), and `dcp.load` finds every key of the plain model's state dict
    (it raises on a missing one)."""
    run_dir, result = _trained(tmp_path)
    out = tmp_path / "dcp"
    assert main(["export", str(run_dir), "--format", "dcp", str(out)]) == 0
    loaded = _load_plain(run_dir, out)
    assert set(result["params"]) <= set(loaded)
    for name, value in result["params"].items():
        assert torch.equal(loaded[name].detach(), value), name


def test_dcp_export_merges_lora_adapters(tmp_path: Path) -> None:
    """A LoRA run exports the plain model with W + (alpha / r)·B·A in each adapted layer (as
    peft's merge), so the plain model computes what the adapted one did."""
    run_dir, result = _trained(tmp_path, *LORA)
    out = tmp_path / "dcp"
    assert main(["export", str(run_dir), "--format", "dcp", str(out)]) == 0
    loaded = _load_plain(run_dir, out)
    params, merged = result["params"], 0
    for name, value in params.items():
        if ".base_layer." not in name:
            if ".lora_" not in name:
                assert torch.equal(loaded[name].detach(), value), name
            continue
        layer = name.removesuffix(".base_layer.weight")
        a, b = params[f"{layer}.lora_A.default.weight"], params[f"{layer}.lora_B.default.weight"]
        want = value + (8 / 4) * b @ a
        got = loaded[f"{layer}.weight"].detach()
        assert torch.allclose(got, want, rtol=0, atol=1e-6), layer  # fp32 rounding of B·A
        merged += 1
    assert merged > 0 and not any(".lora_" in n for n in loaded)


def test_max_shard_size_is_refused_with_dcp(tmp_path: Path, capsys) -> None:
    """--max-shard-size sizes Hugging Face shards only: with --format dcp it is named and
    refused, not silently ignored, and nothing is written."""
    out = tmp_path / "dcp"
    argv = ["export", str(tmp_path / "run"), "--format", "dcp", str(out), "--max-shard-size", "1MB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--max-shard-size 1MB" in err and "--format dcp" in err
    assert not out.exists()
