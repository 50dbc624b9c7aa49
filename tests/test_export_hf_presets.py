"""`shardwise export --format hf` of the hf-* presets (transformers' own Llama and GPT-2
classes trained under their own names): the exported folder loads with transformers'
from_pretrained and computes the trained model's logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.config import load_config  # noqa: E402
from shardwise.launchers.harness import run_here  # noqa: E402
from shardwise.models import build_model  # noqa: E402
from shardwise.training.validate import model_spec  # noqa: E402

SMALL = ["--model.n_layers=1", "--data.seq_len=32"]


@pytest.mark.parametrize("name", ["hf-llama-tiny", "hf-gpt2-tiny"])
def test_hf_preset_export_loads_with_the_trained_logits(tmp_path, name):
    from shardwise.cli.main import main

    over = [f"--model.name={name}", *SMALL]
    case = {"overrides": [*over, "--train.steps=2", "--checkpoint.every=2"]}
    result = run_here(case, str(tmp_path / "run"))
    assert "error" not in result, result.get("error")
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "run"), "--format", "hf", str(out)]) == 0
    spec = model_spec(load_config(None, over))
    ours = build_model(spec).eval()
    missing = ours.load_state_dict(result["params"], strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing  # a tied head is the embedding
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs) is type(ours)
    tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens).logits - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff
