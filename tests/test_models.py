"""shardwise.models: shapes, presets, attention against a reference, layout-invariant init."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.errors import ConfigError
from shardwise.models import PRESETS, ModelSpec, build_model, count_params, init_weights, preset
from shardwise.models.decoder import AttentionCore, apply_rope
from shardwise.models.init import initial_value, param_seed

SEED = 1234


def _init(spec: ModelSpec, seed: int = SEED) -> torch.nn.Module:
    model = build_model(spec)
    init_weights(model, seed)
    return model


def _tokens(spec: ModelSpec, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (batch, seq), generator=gen)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny"])
def test_decoder_shapes_and_backward(name: str) -> None:
    spec = preset(name)
    model = _init(spec)
    logits = model(_tokens(spec))
    assert logits.shape == (2, 16, spec.vocab_size)
    assert logits.dtype == torch.float32
    F.cross_entropy(logits.flatten(0, 1), _tokens(spec, seed=1).flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_resnet18_cifar_stem_shape() -> None:
    spec = preset("resnet18")
    assert spec.cifar_stem and spec.in_channels == 1
    model = _init(spec)
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)


def test_resnet50_imagenet_stem_shape() -> None:
    spec = dataclasses.replace(preset("resnet50"), cifar_stem=False, in_channels=3, num_classes=7)
    model = _init(spec).eval()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 7)


def test_module_paths_are_the_contract() -> None:
    names = dict(_init(preset("tiny")).named_modules())
    for path in ("embed", "blocks.0.attn_norm", "blocks.0.attn.wq", "blocks.0.attn.wk",
                 "blocks.0.attn.wv", "blocks.0.attn.wo", "blocks.0.attn.core",
                 "blocks.0.mlp_norm", "blocks.0.mlp.w1", "blocks.0.mlp.w2", "blocks.0.mlp.w3",
                 "blocks.0.mlp.act", "norm", "head"):  # fmt: skip
        assert path in names, path
    gpt2 = dict(_init(preset("gpt2-tiny")).named_modules())
    assert "pos_embed" in gpt2 and "blocks.0.mlp.w3" not in gpt2
    for parameter_free in ("blocks.0.attn.core", "blocks.0.mlp.act"):
        assert not list(names[parameter_free].parameters())


def test_tied_embeddings_share_one_parameter() -> None:
    spec = preset("gpt2-tiny")
    model = _init(spec)
    assert model.head.weight is model.embed.weight
    assert sum(1 for n, _ in model.named_parameters() if n in ("embed.weight", "head.weight")) == 1
    untied = _init(preset("tiny"))
    assert untied.head.weight is not untied.embed.weight


def test_init_is_deterministic_and_seed_dependent() -> None:
    a, b = _params(_init(preset("tiny"))), _params(_init(preset("tiny")))
    c = _params(_init(preset("tiny"), seed=SEED + 1))
    assert all(torch.equal(a[n], b[n]) for n in a)
    random_params = [n for n in a if n.endswith(("wq.weight", "w1.weight", "embed.weight"))]
    assert all(not torch.equal(a[n], c[n]) for n in random_params)


def test_init_on_meta_then_to_empty_equals_cpu_init() -> None:
    for name in ("tiny", "gpt2-tiny", "resnet18"):
        with torch.device("meta"):
            model = build_model(preset(name))
        model.to_empty(device="cpu")
        init_weights(model, SEED)
        reference = _init(preset(name))
        for (n, p), (_, q) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert torch.equal(p, q), n
        x = _tokens(preset(name)) if name != "resnet18" else torch.randn(2, 1, 8, 8)
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_init_of_a_parameter_ignores_the_others() -> None:
    shallow = _params(_init(dataclasses.replace(preset("tiny"), n_layers=2)))
    deep = _params(_init(dataclasses.replace(preset("tiny"), n_layers=4)))
    # Everything shared is equal except the depth-scaled output projections.
    shared = [n for n in shallow if not n.endswith(("attn.wo.weight", "mlp.w2.weight"))]
    assert len(shared) > 10
    assert all(torch.equal(shallow[n], deep[n]) for n in shared)
    # A parameter's value is the documented function of (seed, name) only.
    scaled = initial_value(torch.nn.Linear(1, 1), "weight", "x", (4, 4), SEED, None)
    assert torch.equal(
        scaled, initial_value(torch.nn.Linear(9, 9), "weight", "x", (4, 4), SEED, None)
    )
    assert param_seed(SEED, "x") == param_seed(SEED, "x") < 2**63


def test_init_rules() -> None:
    spec = preset("tiny")
    p = _params(_init(spec))
    torch.testing.assert_close(p["blocks.0.attn.wq.weight"].std().item(), 0.02, rtol=0.05, atol=0)
    out_std = 0.02 / math.sqrt(2 * spec.n_layers)
    for name in ("blocks.1.attn.wo.weight", "blocks.1.mlp.w2.weight"):
        torch.testing.assert_close(p[name].std().item(), out_std, rtol=0.05, atol=0)
    assert torch.equal(p["norm.weight"], torch.ones(spec.dim))
    gpt2 = _params(_init(preset("gpt2-tiny")))
    assert torch.count_nonzero(gpt2["blocks.0.attn.wq.bias"]) == 0
    assert torch.count_nonzero(gpt2["blocks.0.mlp_norm.bias"]) == 0
    resnet = _init(preset("resnet18"))
    r = _params(resnet)
    assert torch.count_nonzero(r["layer1.0.bn2.weight"]) == 0  # zero-init residual gamma
    assert torch.equal(r["layer1.0.bn1.weight"], torch.ones(64))
    torch.testing.assert_close(r["fc.weight"].std().item(), 0.01, rtol=0.1, atol=0)
    assert torch.equal(resnet.bn1.running_var, torch.ones(64))


def test_causal_masking() -> None:
    for name in ("tiny", "gpt2-tiny"):
        spec = preset(name)
        model = _init(spec)
        tokens = _tokens(spec, batch=1, seq=12)
        changed = tokens.clone()
        changed[0, 8:] = (changed[0, 8:] + 1) % spec.vocab_size
        a, b = model(tokens), model(changed)
        torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=1e-6)
        assert not torch.allclose(a[:, 8:], b[:, 8:])


def _reference_attention(q, k, v, theta):  # q [B,S,H,D], k/v [B,S,KV,D]; naive, no SDPA
    pos = torch.arange(q.shape[1])
    q, k = apply_rope(q, pos, theta), apply_rope(k, pos, theta)
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhst,bthd->bshd", probs, v)


def test_gqa_attention_core_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 10, 4, 8, generator=gen)
    k, v = torch.randn(2, 2, 10, 2, 8, generator=gen).unbind(0)
    out = AttentionCore(rope_theta=10000.0)(q, k, v)
    assert out.shape == q.shape
    torch.testing.assert_close(out, _reference_attention(q, k, v, 10000.0))
    spec = preset("tiny")
    assert spec.n_kv_heads < spec.n_heads
    assert _init(spec).blocks[0].attn.wk.weight.shape == (spec.n_kv_heads * spec.head_dim, spec.dim)


def test_rope_scores_depend_only_on_relative_position() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 16, generator=gen).unbind(0)

    def score(m: int, n: int) -> torch.Tensor:
        rq = apply_rope(q, torch.tensor([m]), 10000.0)
        rk = apply_rope(k, torch.tensor([n]), 10000.0)
        return (rq * rk).sum()

    torch.testing.assert_close(score(3, 1), score(103, 101))
    assert not torch.allclose(score(3, 1), score(3, 2))


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny"])
def test_bf16_forward_is_finite(name: str) -> None:
    spec = preset(name)
    model = _init(spec).to(torch.bfloat16)
    logits = model(_tokens(spec))
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()


def test_big_presets_build_on_meta_with_expected_size() -> None:
    expected = {"125m": (1.2e8, 1.35e8), "1b": (1.3e9 * 0.9, 1.3e9 * 1.1)}
    expected |= {
        n: (v * 0.97, v * 1.03) for n, v in [("7b", 6.7e9), ("70b", 6.9e10), ("175b", 1.75e11)]
    }
    for name, (low, high) in expected.items():
        with torch.device("meta"):
            model = build_model(preset(name))
        assert low <= count_params(model) <= high, (name, count_params(model))
        assert all(p.is_meta for p in model.parameters())


def test_count_params_matches_the_formula() -> None:
    s = preset("tiny")
    kv = s.n_kv_heads * s.head_dim
    block = 2 * s.dim * s.dim + 2 * s.dim * kv + 3 * s.dim * s.ffn_dim + 2 * s.dim
    model = _init(s)
    assert count_params(model) == s.n_layers * block + s.dim + 2 * s.vocab_size * s.dim
    assert count_params(model, exclude_embedding=True) == count_params(model) - s.vocab_size * s.dim
    g = preset("gpt2-tiny")
    tied = _init(g)  # tied weight counted once and kept (it is the head); positions dropped
    pos = g.max_seq_len * g.dim
    assert count_params(tied) == sum(p.numel() for p in tied.parameters())
    assert count_params(tied, exclude_embedding=True) == count_params(tied) - pos


def test_preset_errors_are_clear() -> None:
    with pytest.raises(KeyError, match="known presets"):
        preset("7B-typo")
    with pytest.raises(ConfigError, match="n_kv_heads=3"):
        preset("tiny", n_kv_heads=3)
    with pytest.raises(ConfigError, match="not divisible"):
        ModelSpec("decoder", n_layers=1, dim=100, n_heads=3, vocab_size=8)
    with pytest.raises(ConfigError, match="unknown model field"):
        preset("tiny", depth=3)
    assert set(PRESETS) >= {"tiny", "125m", "1b", "7b", "13b", "70b", "175b", "resnet50"}
    filled = ModelSpec("decoder", n_layers=1, dim=4096, n_heads=32, vocab_size=8)
    assert (filled.n_kv_heads, filled.ffn_dim) == (32, 11008)  # Llama's 2/3*4d rounding


def test_init_rejects_unmaterialised_model() -> None:
    with torch.device("meta"):
        model = build_model(preset("tiny"))
    with pytest.raises(ValueError, match="to_empty"):
        init_weights(model, SEED)


def test_to_empty_keeps_embeddings_tied() -> None:
    with torch.device("meta"):
        model = build_model(preset("gpt2-tiny"))
    model.to_empty(device="cpu")
    assert model.head.weight is model.embed.weight
    assert model.to(torch.bfloat16).head.weight is model.embed.weight


def test_init_ignores_wrappers_and_pipeline_splits() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    spec = preset("gpt2-tiny")
    reference = _params(_init(spec))
    wrapped = build_model(spec)  # activation recomputation inserts a path segment
    for i, block in enumerate(wrapped.blocks):
        wrapped.blocks[i] = checkpoint_wrapper(block)
    init_weights(wrapped, SEED)
    for name, p in wrapped.named_parameters():
        assert torch.equal(p, reference[name.replace("_checkpoint_wrapped_module.", "")]), name
    stage = build_model(spec)  # a last pipeline stage: blocks 2.. and the (tied) head
    stage.blocks = torch.nn.ModuleDict({str(i): stage.blocks[i] for i in (2, 3)})
    stage.embed = stage.pos_embed = None
    init_weights(stage, SEED)
    for name, p in stage.named_parameters():
        assert torch.equal(p, reference["embed.weight" if name == "head.weight" else name]), name
    assert stage(torch.randn(1, 4, spec.dim)).shape == (1, 4, spec.vocab_size)


def test_autocast_bf16_forward() -> None:
    spec = preset("tiny")
    model = _init(spec)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(_tokens(spec))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


# -- layout-free dropout ----------------------------------------------------------------------
def _dropped(split: str, shape: tuple, shard: tuple[int, int] | None, step: int = 3):
    from shardwise.models.dropout import LayoutFreeDropout, random_stream, samples

    drop = LayoutFreeDropout(0.25, split)
    drop.site, drop.shard = "blocks.1.mlp_drop", shard
    with random_stream(7, step), samples([11, 4]):
        return drop(torch.ones(shape))


@pytest.mark.parametrize(("split", "whole"), [("heads", (2, 4, 6, 6)), ("sequence", (2, 8, 5))])
@pytest.mark.parametrize("t", [2, 4])
def test_dropout_shards_are_slices_of_the_whole_mask(split: str, whole: tuple, t: int) -> None:
    """A rank holding shard r of t (heads or sequence rows) drops exactly the entries the
    unsplit run drops there; the keys (step here) change the mask; p is kept on average."""
    full = _dropped(split, whole, None)
    part = (whole[0], whole[1] // t, *whole[2:])
    shards = [_dropped(split, part, (r, t)) for r in range(t)]
    assert torch.equal(torch.cat(shards, dim=1), full)
    assert set(full.unique().tolist()) == {0.0, torch.tensor(1 / 0.75).item()}  # fp32 scale
    assert not torch.equal(_dropped(split, whole, None, step=4), full)


def test_dropout_outside_a_training_step_is_refused() -> None:
    from shardwise.models.dropout import LayoutFreeDropout

    with pytest.raises(RuntimeError, match="random_stream"):
        LayoutFreeDropout(0.1, "sequence")(torch.ones(2, 3, 4))
    assert torch.equal(LayoutFreeDropout(0.1, "sequence").eval()(torch.ones(2)), torch.ones(2))
