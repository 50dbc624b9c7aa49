"""Hugging Face interop: weights saved by `transformers` (Llama and GPT-2)
load into our decoders with the same logits, and into tp2 / ZeRO-3 / ZeRO-1 / data
parallelism with the same loss as the single-process run and as transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from shardwise.config import load_config  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.launchers.harness import run_named_worlds  # noqa: E402
from shardwise.models import build_model  # noqa: E402
from shardwise.models.hf.weights import HFWeights, load_weights  # noqa: E402
from shardwise.training.validate import derive, model_spec  # noqa: E402
from support.compare import VOCAB as SMALL_VOCAB  # noqa: E402
from support.compare import case, max_param_diff, max_rel  # noqa: E402
from support.hf_tiny import tiny_llama_config  # noqa: E402

VOCAB = SMALL_VOCAB  # the tokenizer cache the other tests use
# lr 3e-4 as test_tensor.py's Hugging Face cases: an entry whose gradient is zero up to fp32
# rounding (summed in another order by another layout) moves by up to ±lr per Adam step
# (testing/compare.py); at lr 1e-3 one of the 262k embedding entries ends 1.3e-5 apart, every
# other entry within 2e-7.
STEPS = ["--train.steps=5", "--train.lr=3e-4"]


def _perturb(model: torch.nn.Module) -> None:
    """Norm gains of 1 and zero biases would hide a swapped or transposed tensor."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)


def _save_llama(out: Path) -> Path:
    torch.manual_seed(1)
    cfg = tiny_llama_config(VOCAB, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    _perturb(model)
    model.save_pretrained(out)
    return out


def _save_gpt2(out: Path) -> Path:
    torch.manual_seed(2)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    _perturb(model)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"llama": _save_llama(root / "llama"), "gpt2": _save_gpt2(root / "gpt2")}


NAMES = {"llama": "tiny", "gpt2": "gpt2-tiny"}


def _overrides(kind: str, path: Path) -> list[str]:
    # random weights saved without a tokenizer: the other tests' BPE cache (the checkpoint's own
    # tokenizer, data.tokenizer=auto, is tested in test_pretrained_tokenizer.py)
    return [f"--model.name={NAMES[kind]}", f"--model.init_from={path}", "--data.tokenizer=bpe"]


def _import(kind: str, path: Path) -> torch.nn.Module:
    """Our model with the transformers checkpoint at `path` loaded, before any step."""
    spec = model_spec(load_config(None, _overrides(kind, path)))
    model = build_model(spec)
    with torch.no_grad():
        load_weights(model, HFWeights(path, spec.arch))
    return model


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_import_gives_transformers_logits(hf_dirs, kind):
    path = hf_dirs[kind]
    ours = _import(kind, path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_span_reads_only_the_asked_elements(hf_dirs):
    """A ZeRO-3 slice cut anywhere in a transposed, fused GPT-2 weight equals the same slice
    of the full parameter."""
    src = HFWeights(hf_dirs["gpt2"], "gpt2")
    for name, shape in (("blocks.1.attn.wk.weight", (64, 64)), ("blocks.0.attn.wv.bias", (64,))):
        full = src.full(name, shape).flatten()
        for a, b in ((0, 5), (37, 1000), (4000, 4096), (70, 71)):
            b = min(b, full.numel())
            assert torch.equal(src.span(name, shape, a, b), full[a:b]), (name, a, b)


def test_bad_init_from_is_one_clear_error(hf_dirs, tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        derive(load_config(None, [f"--model.init_from={tmp_path / 'nope'}"]), 1)
    with pytest.raises(ConfigError, match=r"Fix: --model\.name=gpt2-tiny"):
        derive(load_config(None, [f"--model.init_from={hf_dirs['gpt2']}"]), 1)
    with pytest.raises(ConfigError, match=r"model.dim=128 but .* has dim=64"):
        derive(load_config(None, [*_overrides("llama", hf_dirs["llama"]), "--model.dim=128"]), 1)


def _first_batch_loss(kind: str, path: Path) -> float:
    """transformers' own loss on the first global batch our data pipeline feeds."""
    from shardwise.data import GlobalSampler, load_data
    from shardwise.training.runtime import data_spec
    from support.compare import SMALL

    cfg = load_config(None, [*SMALL, *_overrides(kind, path)])
    data = load_data(data_spec(cfg, VOCAB), "train")
    idx = GlobalSampler(len(data), cfg.train.global_batch, cfg.train.seed).global_indices(0)
    inputs, targets = data.get_batch(idx)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(inputs).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss.item() / targets.numel()


CKPT = ("llama", "gpt2", "z3_gpt2", "tp2_llama")  # runs that also save a checkpoint


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def worlds(hf_dirs, ckpt_root):
    w1 = {k: case(*_overrides(k, p), *STEPS) for k, p in hf_dirs.items()}
    w2 = {
        f"z3_{k}": case(*_overrides(k, p), *STEPS, "--parallel.zero=3") for k, p in hf_dirs.items()
    }
    w2["dp_llama"] = case(*_overrides("llama", hf_dirs["llama"]), *STEPS)
    for k, p in hf_dirs.items():
        w2[f"tp2_{k}"] = case(*_overrides(k, p), *STEPS, "--parallel.tp=2")
    w2["z1_gpt2"] = case(*_overrides("gpt2", hf_dirs["gpt2"]), *STEPS, "--parallel.zero=1")
    for name in CKPT:
        cases = w1 if name in w1 else w2
        cases[name]["overrides"] += ["--checkpoint.every=5", f"--checkpoint.dir={ckpt_root / name}"]
    both = run_named_worlds({1: w1, 2: w2})
    out = {**both[1], **both[2]}
    out["hf_dirs"] = hf_dirs
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_imported_run_starts_at_transformers_loss(hf_dirs, worlds, kind):
    ours = worlds[kind][0]["losses"][0]
    theirs = _first_batch_loss(kind, hf_dirs[kind])
    assert abs(ours - theirs) / theirs <= 1e-5, (ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "ref"),
    [
        ("z3_llama", "llama"),
        ("z3_gpt2", "gpt2"),
        ("tp2_llama", "llama"),
        ("tp2_gpt2", "gpt2"),
        ("dp_llama", "llama"),
        ("z1_gpt2", "gpt2"),
    ],
)
def test_import_into_any_layout_matches_single_process(worlds, name, ref):
    got, want = worlds[name][0], worlds[ref][0]
    assert max_rel(got["losses"], want["losses"]) <= 1e-5
    assert max_param_diff(got["params"], want["params"]) <= 1e-5
    # and it trained from there: the weights moved far beyond that bound (5 Adam steps move
    # a coordinate by up to the sum of the learning rates, 9e-4 here)
    imported = dict(_import(ref, worlds["hf_dirs"][ref]).named_parameters())
    assert max_param_diff(want["params"], imported) >= 3e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", CKPT)
def test_export_round_trip_gives_our_logits(worlds, ckpt_root, tmp_path, name):
    """`shardwise export CKPT --format hf OUT` (several shards + index) loads with
    transformers' from_pretrained and computes our trained model's logits, whatever layout
    wrote the checkpoint (one process, ZeRO-3 slices over 2 ranks, tp2 shards)."""
    from shardwise.cli.main import main

    out = tmp_path / "hf"
    argv = ["export", str(ckpt_root / name), "--format", "hf", str(out)]
    assert main([*argv, "--max-shard-size", "200KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    kind = "gpt2" if "gpt2" in name else "llama"
    spec = model_spec(load_config(None, _overrides(kind, worlds["hf_dirs"][kind])))
    ours = build_model(spec)
    missing = ours.load_state_dict(worlds[name][0]["params"], strict=False).missing_keys
    assert set(missing) <= {"head.weight"}, missing  # a tied head is the embedding
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_exported_config_keeps_the_dropout_rates(hf_dirs, kind):
    """A model trained with dropout exports a config that fine-tunes with the same rates."""
    from shardwise.checkpoint.export import hf_config

    over = [*_overrides(kind, hf_dirs[kind]), "--model.dropout=0.1", "--model.attn_dropout=0.05"]
    config = transformers.AutoConfig.for_model(
        **hf_config(model_spec(load_config(None, over)), "float32")
    )
    if kind == "gpt2":
        assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (0.1, 0.1, 0.05)
    else:
        assert config.attention_dropout == 0.05


def test_export_bad_input_is_one_clear_error(tmp_path, capsys):
    from shardwise.cli.main import main

    assert main(["export", str(tmp_path / "nope"), "--format", "hf", str(tmp_path / "o")]) == 2
    assert "is neither a run directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path)]) == 2
    assert "expected RUN_DIR --format hf OUT" in capsys.readouterr().err
    assert main(["export", "--help"]) == 0


def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_the_tensor(hf_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = hf_dirs["llama"]
    cut, junk, nan = (tmp_path / n for n in ("cut", "junk", "nan"))
    for d in (cut, junk, nan):
        shutil.copytree(src, d)
    data = (src / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    (junk / "model.safetensors").write_bytes(b"\x00" * 1000)
    tensors = load_file(src / "model.safetensors")
    bad = "model.layers.1.mlp.up_proj.weight"
    tensors[bad][3, 5] = float("nan")
    save_file(tensors, nan / "model.safetensors", metadata={"format": "pt"})
    for path in (cut, junk):
        with pytest.raises(ConfigError, match="is not a readable safetensors file") as err:
            _import("llama", path)
        assert str(path / "model.safetensors") in str(err.value)
    with pytest.raises(ConfigError, match=f"tensor '{bad}' .* holds a non-finite value") as err:
        _import("llama", nan)
    assert "[3, 5]" in str(err.value)


def test_export_writes_the_runs_tokenizer_and_a_generation_config(tmp_path):
    """The exported folder turns text into the ids the model was trained on and generates."""
    from shardwise.checkpoint.export import export_hf
    from shardwise.data import data_spec
    from shardwise.data.tokens import prepare_text
    from shardwise.launchers.harness import run_here

    small = ["--model.name=tiny", "--model.n_layers=1", "--data.seq_len=32"]
    case = {"overrides": [*small, "--train.steps=1", "--checkpoint.every=1"]}
    run_here(case, str(tmp_path / "run"))
    export_hf(tmp_path / "run", tmp_path / "out")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    cache, meta = prepare_text(data_spec(load_config(None, small), 4096))
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(cache / "tokenizer.json"))
    text = "def main(argv):\n    return 0\n"
    assert tok(text)["input_ids"] == ours.encode(text).ids
    assert tok.eos_token_id == meta["eos_id"]
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert gen.eos_token_id == meta["eos_id"]
    pipe = transformers.pipeline("text-generation", model=str(tmp_path / "out"))
    out = pipe("def main(", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert out.startswith("def main(") and len(out) > len("def main(")


def test_init_from_into_a_model_that_cannot_take_it_names_what_it_is(hf_dirs):
    for name, what in (("hf-llama-tiny", "transformers' class"), ("resnet18", "a ResNet")):
        with pytest.raises(ConfigError, match=f"model.name='{name}' is {what}") as err:
            derive(
                load_config(
                    None, [f"--model.name={name}", f"--model.init_from={hf_dirs['llama']}"]
                ),
                1,
            )
        assert "--model.name=hf" in str(err.value)
