"""`model.init_from` takes a PyTorch distributed checkpoint (DCP): ours (`shardwise export
--format dcp`) or one in torchtitan's Llama layout (its names, under "model." beside an
optimizer, q/k rows in Meta's RoPE order), and starts training from exactly the weights a
Hugging Face export of the same checkpoint gives — in one process and under ZeRO-3 on 2 ranks,
where each rank reads only its slices.

The torchtitan checkpoint is written here with `torch.distributed.checkpoint.save` from the
trained weights, its q/k rows put in Meta's order by the inverse of the permutation the loader
applies, so a wrong name, a missed permutation or a wrong slice changes the losses.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardwise.cli.main import main
from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.launchers.harness import run_here, run_world
from shardwise.models.spec import spec_from_config
from support.compare import case, max_rel

pytestmark = pytest.mark.slow

SHAPE = ["--model.n_layers=2", "--model.n_kv_heads=2"]  # tiny: 4 query heads, 2 kv heads
NEXT = [*SHAPE, "--train.steps=3", "--train.seed=7"]  # the runs that start from the weights
TITAN = {
    r"embed\.weight": "tok_embeddings.weight",
    r"blocks\.(\d+)\.attn\.w([qkvo])\.weight": "layers.{0}.attention.w{1}.weight",
    r"blocks\.(\d+)\.mlp\.w([123])\.weight": "layers.{0}.feed_forward.w{1}.weight",
    r"blocks\.(\d+)\.attn_norm\.weight": "layers.{0}.attention_norm.weight",
    r"blocks\.(\d+)\.mlp_norm\.weight": "layers.{0}.ffn_norm.weight",
    r"norm\.weight": "norm.weight",
    r"head\.weight": "output.weight",
}


def _meta_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q/k from pairs (i, i + D/2) back to Meta's (2i, 2i+1), per head."""
    out, dim = w.shape
    return w.view(heads, 2, out // heads // 2, dim).transpose(1, 2).reshape(out, dim)


def _titan_dcp(params: dict[str, torch.Tensor], out: Path, nested: bool = True) -> None:
    """Our parameters under torchtitan's names, q/k rows in Meta's RoPE order; under "model."
    beside an optimizer as its step checkpoints keep them, or flat (`nested` False)."""
    model = {}
    for name, value in params.items():
        for ours, theirs in TITAN.items():
            m = re.fullmatch(ours, name)
            if m:
                key = theirs.format(*m.groups())
                if key.endswith((".wq.weight", ".wk.weight")):
                    value = _meta_order(value, 4 if ".wq." in key else 2)
                model[key] = value.detach().clone()
    assert len(model) == len(params)
    state = {"model": model, "optimizer": {"step": torch.tensor(3.0)}} if nested else model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(out), no_dist=True)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One trained checkpoint, as a Hugging Face export, our DCP export and a torchtitan DCP."""
    root = tmp_path_factory.mktemp("dcp-init")
    trained = run_here(case(*SHAPE, "--train.steps=3", "--checkpoint.every=3"), str(root / "run"))
    out = {"hf": root / "hf", "dcp": root / "dcp", "titan": root / "titan"}
    assert main(["export", str(root / "run"), "--format", "hf", str(out["hf"])]) == 0
    assert main(["export", str(root / "run"), "--format", "dcp", str(out["dcp"])]) == 0
    _titan_dcp(trained["params"], out["titan"])
    return out


def test_dcp_starts_from_the_same_weights_as_the_hf_export(sources, tmp_path) -> None:
    """Ours and torchtitan's DCP give bit-identical losses to the Hugging Face export."""
    tok = f"--data.tokenizer={sources['hf']}"  # torchtitan's DCP holds no tokenizer
    losses = {
        kind: run_here(case(*NEXT, f"--model.init_from={path}", tok), str(tmp_path / kind))[
            "losses"
        ]
        for kind, path in sources.items()
    }
    assert len(losses["hf"]) == 3
    assert losses["dcp"] == losses["hf"]
    assert losses["titan"] == losses["hf"]


def test_dcp_under_zero3_reads_slices(sources, tmp_path) -> None:
    """dp=2 ZeRO-3 from the torchtitan DCP reproduces the one-process run from the Hugging
    Face export within 1e-5 (the project's parity tolerance for a changed reduction order)."""
    one = run_here(case(*NEXT, f"--model.init_from={sources['hf']}"), str(tmp_path / "one"))
    titan = [f"--model.init_from={sources['titan']}", f"--data.tokenizer={sources['hf']}"]
    two = run_world(2, [case(*NEXT, "--parallel.zero=3", *titan)])
    assert "error" not in two[0][0], two[0][0].get("error")
    assert max_rel(two[0][0]["losses"], one["losses"]) <= 1e-5


def test_a_dcp_of_another_shape_is_refused_before_launch(sources) -> None:
    """A DCP holds no config: a model.* shape that does not match is named with the fix."""
    cfg = load_config(None, ["--model.n_layers=3", f"--model.init_from={sources['dcp']}"])
    with pytest.raises(ConfigError, match=r"no tensor for 'blocks\.2\..*Fix: set model.name"):
        spec_from_config(cfg)


def test_a_separate_head_is_not_dropped_by_a_tied_model(sources) -> None:
    """A checkpoint with its own output head loaded into a model that ties its head to the
    embedding would leave that head unread: refused, naming the key that keeps it."""
    cfg = load_config(
        None, [*SHAPE, "--model.tie_embeddings=true", f"--model.init_from={sources['titan']}"]
    )
    with pytest.raises(ConfigError, match=r"output head of its own \('model\.output\.weight'\)"):
        spec_from_config(cfg)
