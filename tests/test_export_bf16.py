"""`shardwise export --format hf` of bf16 runs (precision.compute=bf16): our decoder (as
transformers' Llama) and the MoE decoder (as Qwen2-MoE), one process, 3 steps each.

A bf16 run keeps fp32 master weights apart from its bf16 parameters, and the export writes the
masters (docs/fine-tuning.md): every exported tensor and config.json's dtype are float32.
Checked against references: the run's bf16 parameters are the masters rounded to bf16 bit for
bit, so `from_pretrained(OUT, dtype=torch.bfloat16)` holds exactly the weights the run computed
with; in fp32 transformers gives the logits of our model holding the masters; in bf16 both
stay within a bound derived from bf16's rounding of the exact (fp64) logits of those weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from shardwise.checkpoint import io, slices  # noqa: E402
from shardwise.cli.main import main  # noqa: E402
from shardwise.config import load_config  # noqa: E402
from shardwise.launchers.harness import run_named  # noqa: E402
from shardwise.models import build_model  # noqa: E402
from shardwise.models.spec import spec_from_config  # noqa: E402
from support.compare import SMALL, VOCAB, case  # noqa: E402

BF16 = ["--precision.compute=bf16", "--train.steps=3", "--checkpoint.every=3"]
MODELS = {"dense": "--model.name=tiny", "moe": "--model.name=moe-tiny"}
CLASSES = {"dense": "LlamaForCausalLM", "moe": "Qwen2MoeForCausalLM"}
IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
# bf16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of itself
U = 2.0**-8


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, dict]:
    """Each bf16 run's checkpoint (masters and parameters by name) and its export folder."""
    root = tmp_path_factory.mktemp("bf16-export")
    cases = {k: case(m, *BF16, f"--run.dir={root / k}") for k, m in MODELS.items()}
    run_named(1, cases)
    out = {}
    for kind in MODELS:
        ckpt = root / kind / "checkpoints" / "step-00000003"
        index = io.read_index(ckpt)
        stored = {k: slices.read_tensor(ckpt, k, index) for k in index["tensors"]}
        hf = root / f"{kind}-hf"
        assert main(["export", str(root / kind), "--format", "hf", str(hf)]) == 0
        out[kind] = {
            "masters": {k[7:]: v for k, v in stored.items() if k.startswith("master/")},
            "params": {k[6:]: v for k, v in stored.items() if k.startswith("param/")},
            "hf": hf,
        }
    return out


def _ours(kind: str, values: dict[str, torch.Tensor], dtype: torch.dtype):
    """Our model of run `kind` holding `values`, computing in `dtype`: its logits on IDS, the
    final norm's output (what the head reads) and the head's weight, in fp64."""
    model = build_model(spec_from_config(load_config(None, [*SMALL, MODELS[kind], *BF16])))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name])
    model = model.to(dtype).eval()
    seen = {}
    model.norm.register_forward_hook(lambda mod, args, out: seen.update(n=out.double()))
    with torch.no_grad():
        logits = model(IDS).double()
    return logits, seen["n"], model.head.weight.double()


def _theirs(path: Path, dtype: torch.dtype) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(IDS).logits.double()


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_bf16_run_exports_its_fp32_masters(exported, kind):
    """The masters, as docs/fine-tuning.md says: fp32 tensors and config.json, and the run's
    bf16 parameters are those masters rounded to bf16, bit for bit."""
    run = exported[kind]
    config = json.loads((run["hf"] / "config.json").read_text())
    assert config["architectures"] == [CLASSES[kind]]
    assert config["torch_dtype"] == "float32", config.get("torch_dtype")
    tensors = {}
    for f in run["hf"].glob("*.safetensors"):
        tensors.update(load_file(f))
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    params, masters = run["params"], run["masters"]
    assert params and set(params) == set(masters)
    for name, p in params.items():
        assert p.dtype == torch.bfloat16 and masters[name].dtype == torch.float32, name
        assert torch.equal(masters[name].to(torch.bfloat16), p), name


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_fp32_export_gives_the_masters_logits(exported, kind):
    """fp32 from_pretrained of the export: our model holding the masters within 1e-5 (the same
    products in another order, logits of size ~1), and not our model holding the bf16
    parameters (> 1e-4 away: the export holds the masters, not the rounded copy)."""
    run = exported[kind]
    theirs = _theirs(run["hf"], torch.float32)
    masters, _, _ = _ours(kind, run["masters"], torch.float32)
    rounded, _, _ = _ours(kind, run["params"], torch.float32)
    assert (theirs - masters).abs().max().item() <= 1e-5
    assert (theirs - rounded).abs().max().item() > 1e-4
    assert masters.abs().max() > 0.1  # logits of a trained model, not zeros


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_bf16_export_computes_as_our_bf16_model(exported, kind):
    """from_pretrained(OUT, dtype=bf16) rounds the masters to the run's bf16 weights (the test
    above), so it and our bf16 model compute from the same weights and differ only where each
    rounds intermediate results to bf16. Each is held to the exact logits R of those weights
    (fp64) within a first-order rounding budget B, so they are within 2B of each other."""
    run = exported[kind]
    theirs = _theirs(run["hf"], torch.bfloat16)
    ours, _, _ = _ours(kind, run["params"], torch.bfloat16)
    exact, n, head = _ours(kind, run["params"], torch.float64)
    # The head reads n (the final norm's output, rounded to bf16) and sums dim products in
    # fp32: an error of e relative per element of n moves logit i by at most e·S_i, with
    # S_i = sum_j |W_ij|·|n_j|, and the logit's own rounding adds U·|R_i|. n carries U from
    # its own rounding plus U for each residual add upstream (2 per block, 2 blocks), which
    # reach it relatively unchanged through the normalisation: e <= 5·U. Roundings inside
    # the attention and MLP branches enter the stream scaled by the branch's size relative to
    # it; this first-order budget leaves them out (measured: each side uses under a fifth of B).
    budget = U * exact.abs() + 5 * U * (n.abs() @ head.abs().t())
    assert ((ours - exact).abs() <= budget).all(), ((ours - exact).abs() / budget).max()
    assert ((theirs - exact).abs() <= budget).all(), ((theirs - exact).abs() / budget).max()
    assert ((theirs - ours).abs() <= 2 * budget).all()
    assert exact.abs().max() > 0.1  # logits of a trained model, not zeros
