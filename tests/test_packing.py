"""Packing instruction records into rows (`data.pack=true`): several records
share a row, attention stays within each record and its positions restart, so every record's
loss is the one it has alone; packed runs reproduce one process in every layout.

One spawned world runs every multi-rank case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import load_config
from shardwise.data import data_spec, load_data
from shardwise.errors import ConfigError
from shardwise.launchers.harness import run_named_worlds
from shardwise.training.validate import derive
from support.compare import max_param_diff, max_rel

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

from test_instruct import instruction_checkpoint  # noqa: E402

SEQ = 384  # the records here are 147-211 tokens: two per row


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny Llama checkpoint (random weights), its tokenizer trained here, Alpaca records."""
    root = tmp_path_factory.mktemp("packing")
    instruction_checkpoint(root, max_positions=512)
    return root


def _overrides(root, *extra: str, hf: bool = True) -> list[str]:
    return [
        *(["--model.name=hf"] if hf else []),  # else the built-in decoder, the checkpoint's shape
        f"--model.init_from={root / 'ckpt'}",
        f"--data.dataset={root / 'inst.jsonl'}",
        "--data.format=instruction",
        f"--data.seq_len={SEQ}",
        "--data.val_fraction=0",
        f"--data.cache_dir={root / 'cache'}",
        "--train.global_batch=4",
        "--train.steps=4",
        "--train.lr=1e-3",
        "--optim.warmup_steps=1",
        "--train.eval_every=0",
        "--train.eval_batches=0",
        "--finetune.lora_rank=4",
        "--data.pack=true",
        *extra,
    ]


def _data(root, pack: bool):
    cfg = load_config(None, _overrides(root, f"--data.pack={str(pack).lower()}"))
    return load_data(data_spec(cfg, 320), "train")


def test_a_packed_row_holds_whole_records_with_their_targets(root):
    """Rows hold consecutive records, each with its own ids and targets (the prompt carries no
    loss), numbered 1, 2, ... in the row; the filler is record 0 without targets; the loss
    normaliser counts the same target tokens packed or not."""
    plain, packed = _data(root, False), _data(root, True)
    assert len(packed) < len(plain) and packed.rows[-1] == len(plain)
    x, y = packed.get_batch(torch.arange(len(packed)))
    assert x.shape == (len(packed), 2, SEQ) and y.shape == (len(packed), SEQ)
    tok = transformers.AutoTokenizer.from_pretrained(root / "ckpt")
    for r in range(len(packed)):
        at = 0
        for k, i in enumerate(range(packed.rows[r], packed.rows[r + 1]), start=1):
            n = int(plain.lengths[i])
            xi, yi = plain.get_batch(torch.tensor([i]))
            assert torch.equal(x[r, 0, at : at + n], xi[0, :n])
            assert torch.equal(y[r, at : at + n], yi[0, :n])
            assert (x[r, 1, at : at + n] == k).all()
            at += n
        assert (x[r, 1, at:] == 0).all() and (y[r, at:] == -100).all()
    text = tok.decode(x[0, 0][x[0, 1] == 2])  # the second record of row 0, decoded
    assert text.count("### Instruction:") == 1 and "### Response:" in text
    prompt = x[0, 0][(x[0, 1] == 2) & (y[0] == -100)]
    prompt = tok.decode(prompt, skip_special_tokens=True)
    assert prompt.startswith("Below is an instruction") and prompt.endswith("### Response:")
    every = torch.arange(len(packed))
    assert packed.targets_in(every) == plain.targets_in(torch.arange(len(plain)))


def _record_losses(model, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Summed cross-entropy of each record of packed row x [2, S] / targets y [S]."""
    with torch.no_grad():
        logits = model(x[None])
    logits = getattr(logits, "logits", logits)[0]
    losses = F.cross_entropy(logits.float(), y, ignore_index=-100, reduction="none")
    return [losses[x[1] == k].sum().item() for k in range(1, int(x[1].max()) + 1)]


@pytest.mark.parametrize("kind", ["hf", "decoder"])
def test_each_packed_record_has_the_loss_it_has_alone(root, kind):
    """A packed record's summed loss equals the record's loss alone in a padded row (1e-5
    relative: the masked and the causal attention kernels round differently), for a Hugging
    Face Llama (position_ids and a 4-D mask) and the built-in decoder (RoPE positions and a
    block-diagonal SDPA mask)."""
    from shardwise.models import build_model, init_weights, to_empty
    from shardwise.models.packing import take_packed_tokens

    if kind == "hf":
        model = transformers.AutoModelForCausalLM.from_pretrained(root / "ckpt").eval()
        take_packed_tokens(model)
    else:
        spec = derive(load_config(None, _overrides(root, hf=False)), 1).spec
        with torch.device("meta"):
            model = build_model(spec)
        to_empty(model, torch.device("cpu"))
        init_weights(model, 0)
        model.eval()
    plain, packed = _data(root, False), _data(root, True)
    for r in range(3):
        x, y = packed.get_batch(torch.tensor([r]))
        together = _record_losses(model, x[0], y[0])
        alone = []
        for i in range(packed.rows[r], packed.rows[r + 1]):
            xi, yi = plain.get_batch(torch.tensor([i]))
            with torch.no_grad():
                out = model(xi)
            logits = getattr(out, "logits", out)[0].float()
            alone.append(F.cross_entropy(logits, yi[0], ignore_index=-100, reduction="sum").item())
        assert len(together) == len(alone) == 2
        assert max_rel(together, alone) <= 1e-5, (together, alone)


def test_the_explicit_attention_masks_records_like_sdpa():
    """With attention dropout the decoder computes the softmax itself: at p = 0 it equals the
    masked SDPA on a packed row."""
    from shardwise.models.decoder import AttentionCore
    from shardwise.models.packing import unpack

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, 4, 8, generator=g) for _ in range(3))
    records = torch.tensor([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12])
    core = AttentionCore(None)  # no RoPE: the two paths see the same q and k
    _, core.packed = unpack(torch.stack([torch.zeros_like(records), records], 1), q.dtype)
    sdpa = core(q, k, v)
    t = lambda a: a.transpose(1, 2)  # noqa: E731
    explicit = core._explicit(t(q), t(k), t(v)).transpose(1, 2)
    assert (explicit - sdpa).abs().max() <= 1e-6


@pytest.fixture(scope="module")
def worlds(root):
    hf, dec = _overrides(root), _overrides(root, hf=False)
    one = {"hf": {"overrides": hf}, "dec": {"overrides": dec}}
    two = {
        "hf_z3": {"overrides": [*hf, "--parallel.zero=3"]},
        "hf_tp2": {"overrides": [*hf, "--parallel.tp=2"]},
        "dec_z2": {"overrides": [*dec, "--parallel.zero=2"]},
        "dec_tp2_sp": {"overrides": [*dec, "--parallel.tp=2", "--parallel.sp=true"]},
    }
    return run_named_worlds({1: one, 2: two})


@pytest.mark.parametrize("name", ["hf_z3", "hf_tp2", "dec_z2", "dec_tp2_sp"])
def test_packed_runs_reproduce_one_process(worlds, name):
    ref = worlds[1][name.split("_")[0]][0]
    got = worlds[2][name][0]
    assert max_rel(got["losses"], ref["losses"]) <= 1e-5
    assert max_param_diff(got["params"], ref["params"]) <= 1e-5
    assert any(v.abs().max() > 0 for k, v in ref["params"].items() if ".lora_B." in k)


def test_explain_predicts_the_packed_job(worlds, root):
    """The planner's activations (the fake forward of the HF model sees the packed input and
    its mask) within 5 % of the run's, model states exact."""
    from shardwise.job.explain import explain_record
    from shardwise.plan.hardware import get_hardware

    cfg = load_config(None, _overrides(root, hf=False))
    pred = explain_record(cfg, 1, get_hardware("cpu", calibrate=False))["mem_bytes"]
    got = worlds[1]["dec"][0]["records"][-1]["mem_bytes"]
    for key in ("params", "grads", "master", "optimizer"):
        assert pred[key] == got[key], (key, pred, got)
    for key in ("activations", "total"):
        assert abs(pred[key] - got[key]) <= 0.05 * got[key], (key, pred[key], got[key])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data.format=text"], "text data is one stream of documents"),
        (["--parallel.pp=2", "--train.micro_batch=1"], "the later stages receive hidden"),
    ],
)
def test_packing_is_refused_where_it_cannot_mask(root, extra, message):
    cfg = load_config(None, _overrides(root, *extra, hf=False))
    with pytest.raises(ConfigError, match=message):
        derive(cfg, 2)


def test_packing_a_custom_module_is_refused(root):
    mine = [o for o in _overrides(root) if not o.startswith(("--model.", "--finetune."))]
    user = "--model.name=tests.user.models:transformer"
    cfg = load_config(None, [*mine, user, f"--data.tokenizer={root / 'ckpt'}"])
    with pytest.raises(ConfigError, match="packed rows need a model that masks"):
        derive(cfg, 1)
