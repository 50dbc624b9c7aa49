"""`shardwise export` of model directories that are not shardwise runs: a Hugging Face
Llama/GPT-2 directory (sharded or not) to a PyTorch distributed checkpoint (DCP), and a
torchtitan-layout DCP (flat, or under "model." beside an optimizer) to Hugging Face
safetensors that transformers loads; and the refusals for everything else.

References: the tensors `model.init_from` of the Hugging Face directory loads (and the raw
safetensors), the first loss of a run started from that directory, and transformers' own
logits of the exported folder against our model's logits read from the DCP.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from shardwise.cli.main import main  # noqa: E402
from shardwise.config import load_config  # noqa: E402
from shardwise.launchers.harness import run_here  # noqa: E402
from shardwise.models import build_model  # noqa: E402
from shardwise.models.dcp import DCPWeights, tensor_sizes  # noqa: E402
from shardwise.models.hf.weights import HFWeights, load_weights  # noqa: E402
from shardwise.models.spec import spec_from_config  # noqa: E402
from support.compare import VOCAB, case  # noqa: E402
from support.hf_tiny import tiny_llama_config  # noqa: E402
from test_init_from_dcp import _titan_dcp  # noqa: E402

pytestmark = pytest.mark.slow

NAMES = {"llama": "tiny", "gpt2": "gpt2-tiny"}
EMBED = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}
# tiny with 2 layers, 4 query and 2 kv heads, the tests' 512-token vocabulary
TITAN_KEYS = ["--model.name=tiny", "--model.n_layers=2", "--model.n_kv_heads=2"]
TITAN_KEYS.append(f"--model.vocab_size={VOCAB}")


def _perturb(model: torch.nn.Module) -> None:
    """Norm gains of 1 and zero biases would hide a swapped or transposed tensor."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)


def _save_hf(kind: str, out: Path, **extra) -> Path:
    torch.manual_seed(3)
    if kind == "llama":
        cfg = tiny_llama_config(
            VOCAB,
            tie_word_embeddings=False,
            **{"rms_norm_eps": 1e-5, **extra},  # the preset's (a DCP cannot carry another)
        )
    else:
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    _perturb(model)
    # Llama in several shards (an index), GPT-2 in one file
    model.save_pretrained(out, max_shard_size="100KB" if kind == "llama" else "2GB")
    return out


def _keys(stdout: str) -> list[str]:
    """The model.* keys the export printed for reading the DCP back."""
    line = next(ln for ln in stdout.splitlines() if "reads it with:" in ln)
    return line.split("reads it with:", 1)[1].split()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-models")
    return {kind: _save_hf(kind, root / kind) for kind in NAMES}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_dir_to_dcp_loads_exactly_what_init_from_would(hf_dirs, kind, tmp_path, capsys):
    """`dcp.load` into a plain model (zeroed first) gives, tensor for tensor and bit for bit,
    the model `model.init_from` of the Hugging Face directory loads; the embedding equals the
    raw safetensors tensor."""
    path, out = hf_dirs[kind], tmp_path / "dcp"
    if kind == "llama":
        assert (path / "model.safetensors.index.json").is_file()  # a sharded directory
    assert main(["export", str(path), "--format", "dcp", str(out)]) == 0
    assert f"--model.name={NAMES[kind]}" in _keys(capsys.readouterr().out)
    spec = spec_from_config(
        load_config(None, [f"--model.name={NAMES[kind]}", f"--model.init_from={path}"])
    )
    want = build_model(spec)
    load_weights(want, HFWeights(path, spec.arch))
    got = build_model(spec)
    state = got.state_dict()
    for t in state.values():
        t.zero_()  # nothing of the built model's own init may pass for a loaded value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(state, checkpoint_id=str(out), no_dist=True)
    got.load_state_dict(state)
    expected = want.state_dict()
    assert set(state) == set(expected)
    for key, value in got.state_dict().items():
        assert torch.equal(value, expected[key]), key
    raw = {}
    for f in path.glob("*.safetensors"):
        raw.update(load_file(f))
    assert torch.equal(got.state_dict()["embed.weight"], raw[EMBED[kind]])


def test_init_from_the_dcp_gives_the_hf_dirs_first_loss(hf_dirs, tmp_path, capsys):
    """A run started from the exported DCP, with the model.* keys the export printed, has the
    same first loss as one started from the Hugging Face directory."""
    path, out = hf_dirs["llama"], tmp_path / "dcp"
    assert main(["export", str(path), "--format", "dcp", str(out)]) == 0
    keys = _keys(capsys.readouterr().out)
    common = ["--data.tokenizer=bpe", "--train.steps=1"]
    hf = run_here(
        case("--model.name=tiny", f"--model.init_from={path}", *common), str(tmp_path / "a")
    )
    ours = run_here(case(*keys, f"--model.init_from={out}", *common), str(tmp_path / "b"))
    assert len(hf["losses"]) == 1
    assert ours["losses"] == hf["losses"]


@pytest.mark.parametrize("nested", [True, False], ids=["under-model", "flat"])
def test_titan_dcp_to_hf_gives_our_logits_in_transformers(nested, tmp_path):
    """transformers' from_pretrained of the export computes the logits our model computes
    from the torchtitan DCP, within 1e-5 (fp32; the two differ in op order only)."""
    spec = spec_from_config(load_config(None, TITAN_KEYS))
    torch.manual_seed(5)
    source = build_model(spec)
    _perturb(source)
    titan, out = tmp_path / "titan", tmp_path / "hf"
    _titan_dcp(dict(source.named_parameters()), titan, nested)
    assert main(["export", str(titan), "--format", "hf", str(out), *TITAN_KEYS]) == 0
    ours = build_model(spec)
    load_weights(ours, DCPWeights(titan, spec))
    for name, p in source.named_parameters():  # the permutation undone exactly
        assert torch.equal(dict(ours.named_parameters())[name], p), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert theirs.config.model_type == "llama"
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff


def _err(capsys, *argv: str) -> str:
    assert main(["export", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Fix:" in err and "Traceback" not in err, err
    return err


def test_what_export_cannot_take_is_one_clear_refusal(hf_dirs, tmp_path, capsys):
    """No shape keys for a DCP, a pointless format, a foreign model, --step or training keys
    for a model directory, OUT inside the source, and a folder that is nothing export reads:
    each one line naming the value and the fix; nothing is written."""
    hf, out = hf_dirs["llama"], tmp_path / "out"
    dcp_dir = tmp_path / "dcp"
    assert main(["export", str(hf), "--format", "dcp", str(dcp_dir)]) == 0
    err = _err(capsys, dcp_dir, "--format", "hf", out)
    assert "holds no config" in err and "--model.n_heads" in err, err
    assert "--model.n_layers=2 --model.vocab_size=512 --model.dim=64" in err, err
    assert "would copy it as it is" in _err(capsys, hf, "--format", "hf", out)
    assert "no LoRA adapter" in _err(capsys, hf, "--format", "peft", out)
    assert "would copy it as it is" in _err(capsys, dcp_dir, "--format", "dcp", out)
    assert "--step 3 picks a checkpoint of a run" in _err(
        capsys, hf, "--format", "dcp", out, "--step", "3"
    )
    assert "--train.steps does not apply" in _err(
        capsys, dcp_dir, "--format", "hf", out, "--train.steps=3"
    )
    assert "its config.json gives the shape" in _err(
        capsys, hf, "--format", "dcp", out, "--model.n_layers=2"
    )
    assert "is inside the source model" in _err(capsys, hf, "--format", "dcp", hf / "sub")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    save_file({"w": torch.zeros(2)}, bert / "model.safetensors")
    assert "holds a Hugging Face 'bert' model" in _err(capsys, bert, "--format", "dcp", out)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text('"not a config"')
    err = _err(capsys, junk, "--format", "dcp", out)
    assert "shardwise export takes a run directory" in err and "Hugging Face" in err, err
    err = _err(capsys, tmp_path / "nope", "--format", "dcp", out)
    assert "shardwise export takes" in err, err
    assert not out.exists() and not (hf / "sub").exists()


def test_a_config_value_the_dcp_cannot_carry_is_said(tmp_path, capsys):
    """A Llama whose RMSNorm epsilon is not the preset's: the DCP is written, and a note says
    that model.init_from of it uses the preset's value (there is no model.* key for it)."""
    path = _save_hf("llama", tmp_path / "hf", rms_norm_eps=1e-6)
    assert main(["export", str(path), "--format", "dcp", str(tmp_path / "dcp")]) == 0
    err = capsys.readouterr().err
    assert "note:" in err and "norm_eps=1e-06 (the preset's: 1e-05)" in err, err


def test_a_bf16_directory_stays_bf16_and_loads_exactly(tmp_path):
    """A bf16 Hugging Face directory becomes a bf16 DCP (no doubled size), whose values,
    loaded into the fp32 plain model, are those `model.init_from` of the directory loads."""
    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
    )
    path, out = tmp_path / "hf", tmp_path / "dcp"
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    assert main(["export", str(path), "--format", "dcp", str(out)]) == 0
    assert {d for _, d in tensor_sizes(out).values()} == {torch.bfloat16}
    spec = spec_from_config(load_config(None, ["--model.name=tiny", f"--model.init_from={path}"]))
    want = build_model(spec)
    load_weights(want, HFWeights(path, spec.arch))
    state = {k: torch.zeros_like(v) for k, v in want.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(out), no_dist=True)
    for key, value in want.state_dict().items():
        assert torch.equal(state[key], value), key
