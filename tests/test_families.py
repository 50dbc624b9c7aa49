"""The model-family seam (models/families/): every family answers for itself, and no code
outside `models/` decides by comparing family names, so a new family is one file and one
registry line instead of edits across the layers."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from shardwise.config import load_config
from shardwise.models import build_model, build_on_meta, preset
from shardwise.models.families import FAMILIES, family_of
from shardwise.models.presets import ARCHS, ModelSpec

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"

# A family name compared by string: `spec.arch == "gpt2"`, `arch in (...)`,
# `arch.startswith("resnet")`, `model.name == "hf"`, `task == "classification"`, or the old
# tuples of family names.
FAMILY_COMPARISON = re.compile(
    r"\barch\b\s*(==|!=|\bin\b|\bnot in\b)"
    r"|\barch\.startswith\("
    r"|model\.name\s*(==|!=)"
    r"|\btask\s*(==|!=)"
    r"|\b(HF_ARCHS|RESNET_ARCHS|TRANSFORMER_ARCHS)\b"
)


# The one place allowed, and why: the config tree fills model.name=hf from model.task and
# model.init_from when no name was given (only load_config knows what the user gave), before
# any spec or family exists.
ALLOWED = {"config.py": 'if m.task == "classification" and m.init_from'}


def test_no_family_name_comparison_outside_models() -> None:
    """The pattern above finds nothing in src/ outside models/ (but the one default the config
    tree fills): what differs between families is asked of the family object
    (`family_of(spec)`), never decided by a name."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "models":
            continue
        allowed = ALLOWED.get(str(path.relative_to(SRC)), "\0")
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if FAMILY_COMPARISON.search(line.split("#")[0]) and allowed not in line:
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not found, "family names compared outside models/:\n" + "\n".join(found)


def test_the_pattern_catches_the_comparisons_it_names() -> None:
    """The grep above is not vacuous: each form it forbids matches."""
    for line in (
        'if spec.arch == "gpt2":',
        'x = spec.arch in ("decoder", "gpt2")',
        'spec.arch.startswith("resnet")',
        'if cfg.model.name == "hf":',
        'if cfg.model.task != "causal_lm":',
        "from shardwise.models.presets import HF_ARCHS",
    ):
        assert FAMILY_COMPARISON.search(line), line
    assert not FAMILY_COMPARISON.search("family_of(spec).block.gated_mlp")


def test_every_arch_has_exactly_one_family() -> None:
    """The registry covers every arch a ModelSpec accepts, a checkpoint's once per task."""
    for arch in ARCHS:
        tasks = ("causal_lm", "classification") if arch == "hf" else ("causal_lm",)
        for task in tasks:
            matches = [f for f in FAMILIES if arch in f.archs and f.task in (None, task)]
            assert len(matches) == 1, (arch, task, [f.name for f in matches])


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny", "resnet18"])
def test_building_on_meta_is_one_function(name: str) -> None:
    """`build_on_meta` gives the family's module with no storage, the same structure as a
    real build."""
    spec = preset(name)
    meta = build_on_meta(spec)
    real = build_model(spec)
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert [n for n, _ in meta.named_parameters()] == [n for n, _ in real.named_parameters()]
    assert type(meta) is type(real)


def test_block_shapes_describe_our_two_decoders() -> None:
    """The planner prices a block from its family's description: the Llama-style decoder is
    gated with RoPE and RMSNorm, GPT-2 has LayerNorm, biases and a position table,
    transformers' Llama preset is our decoder's block with its norms registered last, and its
    GPT-2 preset is GPT-2's block with q, k and v fused into one tensor (`c_attn`); both are
    transformers' own blocks (their saved tensors: plan/activations_hf.py), their linears
    named by their own paths for LoRA's targets."""
    llama, gpt2 = family_of(preset("tiny")).block, family_of(preset("gpt2-tiny")).block
    assert llama.gated_mlp and llama.rotary and llama.rms_norm and not llama.biases
    assert gpt2.layer_norm and gpt2.biases and gpt2.learned_positions and not gpt2.gated_mlp
    theirs = family_of(preset("hf-llama-tiny")).block
    hf = dict(transformers=True, linear_paths=theirs.linear_paths)
    assert theirs == dataclasses.replace(llama, norms_last=True, **hf) and not llama.norms_last
    assert [tag for _, tag in theirs.linear_paths] == ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    other = family_of(ModelSpec("hf-gpt2", n_layers=1, dim=8, n_heads=2, vocab_size=300)).block
    hf = dict(transformers=True, linear_paths=other.linear_paths)
    assert other == dataclasses.replace(gpt2, fused_qkv=True, **hf) and not gpt2.fused_qkv
    assert [tag for _, tag in other.linear_paths] == ["wqkv", "wo", "w1", "w2"]
    assert not (llama.transformers or gpt2.transformers or llama.linear_paths)


def test_a_family_refuses_tensor_parallelism_in_its_own_words() -> None:
    """A ResNet and your own module refuse tp > 1 with their family's message, naming the
    model and the fix."""
    from shardwise.errors import ConfigError
    from shardwise.training.validate import derive

    cfg = load_config(None, ["--model.name=resnet18", "--data.dataset=digits"])
    cfg.parallel.tp = 2
    with pytest.raises(
        ConfigError, match=r"model.name='resnet18' is a ResNet. Fix: --parallel.tp=1"
    ):
        derive(cfg, 2)


def test_a_new_family_is_one_object_and_one_registry_line(monkeypatch) -> None:
    """The recipe of docs/architecture.md: a Family with a builder, added to FAMILIES, is
    built by `build_model` and answered for by `family_of` with nothing else changed."""
    import dataclasses

    from shardwise.models import families
    from shardwise.models.families import DECODER

    class Wider(torch.nn.Module):
        def __init__(self, spec: ModelSpec) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(spec.dim, 2 * spec.dim)

    mine = dataclasses.replace(DECODER, name="wider", archs=("decoder",), build=Wider)
    monkeypatch.setattr(families, "FAMILIES", (mine, *families.FAMILIES))
    spec = preset("tiny")
    assert family_of(spec) is mine
    assert isinstance(build_on_meta(spec), Wider)
