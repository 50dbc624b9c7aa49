"""Persistent buffers in the intake of transformers classes (`model.name=hf`): GLM-4-MoE's
routing bias `e_score_correction_bias` (models/hf/buffers.py).

The checkpoint is the GLM-4-MoE export of our MoE decoder with the sigmoid router (moe-tiny at
2 blocks, 4 experts, top-2, a shared expert, the balancing bias moved by
train.moe_bias_balance=0.01 for 3 steps: tests/test_export_moe.py's run), fp32.

Checked: the export trains back as `Glm4MoeForCausalLM` with transformers' own loss at the
first step and the losses of our decoder continuing from the same weights and bias; the bias on
every rank is the exported one (one process; on 2 ranks ep 2 under ZeRO-0, 2 and 3, and dp 2
under ZeRO-1); a
shardwise checkpoint restores it on resume (the run moved it first, so the file's value would
fail the check); `shardwise export --format hf` writes it back; a checkpoint without it is
refused before launch, naming it and the fix; explain counts it in `buffers` as the engine,
and gives the same prediction every time.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.cli.main import main  # noqa: E402
from shardwise.config import load_config  # noqa: E402
from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.job.explain import explain_record  # noqa: E402
from shardwise.launchers.harness import run_named, run_named_worlds  # noqa: E402
from shardwise.models.families import family_of  # noqa: E402
from shardwise.plan.hardware import get_hardware  # noqa: E402
from shardwise.training.validate import derive  # noqa: E402
from support.compare import SMALL, VOCAB, max_rel  # noqa: E402

BIAS = "mlp.gate.e_score_correction_bias"
LAYERS = (0, 1)  # both blocks MoE (first_k_dense_replace=0)
# our sigmoid-router MoE decoder with a shared expert; its bias moved by 0.01 a step
GLM = ["--model.name=moe-tiny", "--model.router=sigmoid", "--model.n_shared_experts=1"]
DATA = [o for o in SMALL if not o.startswith("--model.")]
COMMON = [*DATA, "--optim.warmup_steps=1", "--data.tokenizer=bpe", "--train.steps=2"]
TRAINED: dict[str, torch.Tensor] = {}  # our run's parameters and biases, for `start_from_trained`
MOVE = 0.05  # what `move_bias` adds to each routing bias (several times the trained biases)


def keep_buffers(run) -> None:
    """Hook: the harness returns the model's floating buffers."""
    run.return_buffers = True


def move_bias(run) -> None:
    """Hook: each routing bias moved by MOVE·(expert number) before the first step, so a
    resume that read the bias from the Hugging Face files instead of the run's checkpoint
    would hold another value."""
    run.return_buffers = True
    with torch.no_grad():
        for name, buf in run.model.named_buffers():
            if name.endswith(BIAS):
                buf.add_(MOVE * torch.arange(buf.numel(), dtype=buf.dtype, device=buf.device))


def start_from_trained(run) -> None:
    """Hook: our decoder starts from the trained parameters and balancing biases (`TRAINED`)."""
    run.return_buffers = True
    with torch.no_grad():
        for n, p in run.model.named_parameters():
            p.copy_(TRAINED[n])
        for n, b in run.model.named_buffers():
            if n.endswith(".expert_bias"):
                b.copy_(TRAINED[n])


def _hf(export, *extra: str) -> list[str]:
    return ["--model.name=hf", f"--model.init_from={export}", *COMMON, *extra]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """Our run (3 steps) exported as GLM-4-MoE; its parameters and biases in TRAINED."""
    root = tmp_path_factory.mktemp("hfbuf")
    ours = [*SMALL, *GLM, "--train.steps=3", "--checkpoint.every=3", "--parallel.zero=0"]
    ours += ["--train.moe_bias_balance=0.01", f"--run.dir={root / 'ours'}"]
    run = run_named(1, {"ours": {"overrides": ours, "hook": "test_hf_buffers:keep_buffers"}})
    TRAINED.clear()
    TRAINED.update(run["ours"][0]["params"])
    TRAINED.update({k: v for k, v in run["ours"][0]["buffers"].items() if "expert_bias" in k})
    out = root / "glm-hf"
    assert main(["export", str(root / "ours"), "--format", "hf", str(out)]) == 0
    arch = json.loads((out / "config.json").read_text())["architectures"]
    assert arch == ["Glm4MoeForCausalLM"]
    return root, out


def _case(export, name: str, *extra: str, hook: str = "keep_buffers") -> dict:
    root, out = export
    args = _hf(out, f"--run.dir={root / name}", *extra)
    return {"overrides": args, "hook": f"test_hf_buffers:{hook}"}


@pytest.fixture(scope="module")
def runs(export):
    root, _ = export
    ours = [*SMALL, *GLM, *COMMON, "--parallel.zero=0"]  # the bias held (balance off)
    world1 = {
        "hf": _case(export, "hf", "--parallel.zero=0", "--checkpoint.every=2"),
        "ours": {"overrides": ours, "hook": "test_hf_buffers:start_from_trained"},
        "moved": _case(
            export, "moved", "--train.steps=4", "--checkpoint.every=2", hook="move_bias"
        ),
    }
    # (cases of one process run in this order: the resume reads the moved run's step 2)
    step2 = root / "moved" / "checkpoints" / "step-00000002"
    world1["resumed"] = _case(export, "resumed", "--train.steps=4", f"--checkpoint.resume={step2}")
    world2 = {
        "ep2": _case(export, "ep2", "--parallel.ep=2", "--parallel.zero=0"),
        "z1": _case(export, "z1", "--parallel.zero=1"),
        "ep2_z2": _case(export, "ep2_z2", "--parallel.ep=2", "--parallel.zero=2"),
        "ep2_z3": _case(export, "ep2_z3", "--parallel.ep=2", "--parallel.zero=3"),
    }
    out = run_named_worlds({1: world1, 2: world2})
    return {**out[1], **out[2]}


def _file_biases(out) -> dict[int, torch.Tensor]:
    """The routing biases in the export's safetensors, by layer."""
    from safetensors.torch import load_file

    tensors = load_file(out / "model.safetensors")
    return {i: tensors[f"model.layers.{i}.{BIAS}"] for i in LAYERS}


def _first_batch_loss(cfg, model) -> float:
    """transformers' own loss of `model` on the first global batch of the run `cfg`."""
    import torch.nn.functional as F

    from shardwise.data import GlobalSampler, load_data
    from shardwise.training.runtime import data_spec

    data = load_data(data_spec(cfg, VOCAB), "train")
    idx = GlobalSampler(len(data), cfg.train.global_batch, cfg.train.seed).global_indices(0)
    inputs, targets = data.get_batch(idx)
    with torch.no_grad():
        logits = model(inputs).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss.item() / targets.numel()


def test_the_first_step_loss_is_transformers_own(export, runs):
    """Step 1 of the intake equals from_pretrained's loss on the same batch within 1e-5
    relative: the same fp32 weights and bias through the same class, only the experts' sums
    in another order (our grouped expert matmul, its per-expert loop), a few roundings of a loss
    of ~6. With transformers' biases zeroed the loss moves by more than that, so the bias the
    intake read is the one that counts."""
    _, out = export
    cfg = load_config(None, _hf(out))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    want = _first_batch_loss(cfg, theirs)
    got = runs["hf"][0]["losses"][0]
    assert abs(got - want) / want <= 1e-5, (got, want)
    for i in LAYERS:
        theirs.model.layers[i].mlp.gate.e_score_correction_bias.zero_()
    unbiased = _first_batch_loss(cfg, theirs)
    assert abs(unbiased - want) / want > 1e-4, (unbiased, want)


def test_the_export_trains_back_with_the_losses_of_our_run(runs):
    """The export trained as transformers' class and our decoder continuing from the same
    parameters and biases (its balance off: transformers' class does not move the bias, it is
    state that is not trained) give the same two AdamW losses within 1e-6 relative (fp32: the
    same products in another order)."""
    got, want = runs["hf"][0]["losses"], runs["ours"][0]["losses"]
    assert len(got) == 2 and max_rel(got, want) <= 1e-6, (got, want)


@pytest.mark.parametrize("name", ["hf", "ep2", "z1", "ep2_z2", "ep2_z3"])
def test_every_rank_holds_the_exported_bias(export, runs, name):
    """Each rank's routing biases after two steps equal the export's bit for bit (read whole
    on every rank, not trained) and our run's `expert_bias`; on 2 ranks (ep 2 under ZeRO-0, 2
    and 3; dp 2 under ZeRO-1) the losses reproduce one process's within 1e-5 relative (each
    rank routes its own tokens: the sums of two ranks' products in another order)."""
    _, out = export
    want = _file_biases(out)
    assert all(want[i].abs().max() > 0 for i in LAYERS)  # moved by the balance: not zeros
    ranks = runs[name]
    assert len(ranks) == (1 if name == "hf" else 2)
    for rank in ranks:
        for i in LAYERS:
            held = rank["buffers"][f"model.layers.{i}.{BIAS}"]
            assert torch.equal(held, want[i]), (name, i)
            assert torch.equal(held, TRAINED[f"blocks.{i}.mlp.expert_bias"]), (name, i)
        assert max_rel(rank["losses"], runs["hf"][0]["losses"]) <= 1e-5, name
        if name.startswith("ep2"):
            assert rank["records"][-1]["comm_bytes"]["ep"] > 0


def test_a_resume_restores_the_bias_from_the_run_checkpoint(export, runs):
    """The moved run's biases differ from the export's (so reading them from the Hugging Face
    files again would fail this check); its resume from step 2 holds the moved ones and
    continues with the uninterrupted run's losses bit for bit (same layout)."""
    _, out = export
    file = _file_biases(out)
    moved, resumed = runs["moved"][0], runs["resumed"][0]
    for i in LAYERS:
        key = f"model.layers.{i}.{BIAS}"
        assert (moved["buffers"][key] - file[i]).abs().max() >= MOVE, i
        assert torch.equal(resumed["buffers"][key], moved["buffers"][key]), i
    assert moved["losses"][0] != runs["hf"][0]["losses"][0]  # the moved bias routes otherwise
    assert len(resumed["losses"]) == 2
    assert resumed["losses"] == moved["losses"][2:], (resumed["losses"], moved["losses"])


@pytest.mark.parametrize("name", ["hf", "moved"])
def test_export_writes_the_bias_back(export, runs, name, tmp_path):
    """`shardwise export --format hf` of the intake's run writes each routing bias back under
    the class's name, fp32, equal to the run's (the loaded one; the moved run's moved one), and
    from_pretrained holds it."""
    root, _ = export
    out = tmp_path / name
    assert main(["export", str(root / name), "--format", "hf", str(out)]) == 0
    written = _file_biases(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    for i in LAYERS:
        held = runs[name][0]["buffers"][f"model.layers.{i}.{BIAS}"]
        assert written[i].dtype == torch.float32 and torch.equal(written[i], held), i
        loaded = theirs.model.layers[i].mlp.gate.e_score_correction_bias
        assert torch.equal(loaded, held), i


def test_a_checkpoint_without_the_bias_is_refused(export, tmp_path, capsys):
    """A GLM-4-MoE checkpoint whose safetensors lack the routing biases stops before launch
    with one message naming the buffer and the fix, rather than train with the constructor's
    zeros; an export of a run whose checkpoint holds no buffers is refused the same way."""
    from safetensors.torch import load_file, save_file

    _, out = export
    bare = tmp_path / "bare"
    shutil.copytree(out, bare)
    tensors = {k: v for k, v in load_file(out / "model.safetensors").items() if BIAS not in k}
    save_file(tensors, bare / "model.safetensors", metadata={"format": "pt"})
    args = ["train", *_hf(bare, f"--run.dir={tmp_path / 'run'}")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model.init_from='{bare}': Glm4MoeForCausalLM keeps state"), err
    assert f"(model.layers.0.{BIAS} and 1 more: persistent buffers)" in err, err
    assert "Fix: a checkpoint saved with its buffers" in err and "Traceback" not in err
    spec = derive(load_config(None, _hf(out)), 1).spec
    with pytest.raises(ShardwiseError, match=rf"\(model.layers.0.{BIAS} and 1 more.*Fix: export"):
        family_of(spec).hf_extra(spec, {}, "float32")


def test_a_tensor_of_another_shape_is_refused(export, tmp_path, capsys):
    """A checkpoint whose routing bias, or one of whose parameters, is not of the model's shape
    stops before launch with one message naming the key, both shapes and the fix (one rule for
    both: models/hf/buffers.check_shape)."""
    from safetensors.torch import load_file, save_file

    _, out = export
    tensors = load_file(out / "model.safetensors")
    param = "model.layers.0.self_attn.q_proj.weight"
    for key, kind in ((f"model.layers.0.{BIAS}", "buffer "), (param, "")):
        bad, want = tmp_path / key, tensors[key].shape
        shutil.copytree(out, bad)
        longer = torch.cat([tensors[key], tensors[key][:1]])  # one more row
        save_file({**tensors, key: longer}, bad / "model.safetensors", metadata={"format": "pt"})
        assert main(["train", *_hf(bad, f"--run.dir={tmp_path / 'run'}")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"error: model.init_from='{bad}': '{key}' has shape {list(longer.shape)} but the "
            f"model's {kind}'{key}' is {list(want)}. Fix: the checkpoint of this config."
        ), err


def test_explain_counts_the_bias_in_buffers(export, runs):
    """The routing biases are module buffers: explain prices them in `buffers` with the engine's
    gathered units, and its ep 2 ZeRO-3 prediction of `buffers` (and of the model states)
    equals the run's measured bytes."""
    _, out = export
    cfg = load_config(None, _hf(out, "--parallel.ep=2", "--parallel.zero=3"))
    pred = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))["mem_bytes"]
    for rank in runs["ep2_z3"]:
        got = rank["records"][-1]["mem_bytes"]
        for key in ("params", "grads", "master", "optimizer", "buffers"):
            assert pred[key] == got[key], (key, pred[key], got[key])


@pytest.mark.parametrize(
    "layout", [("--parallel.ep=2", "--parallel.zero=3"), ("--parallel.zero=3",)]
)
def test_explain_gives_the_same_prediction_every_time(export, layout):
    """explain is a function of the config: three explains of the export on 2 ranks (ep 2
    under ZeRO-3, and dp 2) give the same `mem_bytes` byte for byte. GLM-4-MoE's router keeps
    only the indices of its top-k scores, so the forward frees what those branches saved before
    it ends; the saved-tensor meter (training/memory.py), keying storages by an address the
    allocator could give to a later one, counted some of them as already seen and the
    activations changed from one explain to the next (by up to 0.36 MB of 4.5 MB)."""
    _, out = export
    cfg = load_config(None, _hf(out, *layout))
    hardware = get_hardware("cpu", calibrate=False)
    got = [explain_record(cfg, 2, hardware)["mem_bytes"] for _ in range(3)]
    assert got[0] == got[1] == got[2], got
