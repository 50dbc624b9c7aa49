"""train.loss_chunks: the head and cross-entropy a chunk of tokens at a time
(models/chunked_loss.py). The same loss and gradients as the full-logits loss in fp32, the same
training runs (1 rank, ZeRO-3 on 2), the logits gone from the saved activations as the
planner predicts, and one clear refusal where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.launchers.harness import run_cases
from shardwise.models import build_model, init_weights, preset
from shardwise.models.chunked_loss import chunked_loss_sum
from shardwise.plan.hardware import get_hardware
from shardwise.plan.layout import Job, Layout
from shardwise.plan.memory import predict_memory
from shardwise.training.memory import ActivationMeter
from shardwise.training.validate import derive
from support.compare import case, max_param_diff

CHUNKS = [1, 2, 3, 7, 16, 1000]  # 1000 > tokens: one token per chunk


def _targets(b: int, s: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    targets = torch.randint(0, vocab, (b, s), generator=g)
    targets[:, : s // 3] = -100  # an instruction mask: the prompt is not a target
    targets[0, -2:] = -100  # padding
    return targets


@pytest.mark.parametrize("chunks", CHUNKS)
def test_the_function_matches_cross_entropy(chunks):
    g = torch.Generator().manual_seed(chunks)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(97, 16, generator=g)).requires_grad_(True)
    t = _targets(1, 37, 97, g).flatten()
    count = int((t != -100).sum())
    ref = F.cross_entropy(F.linear(h, w).float(), t, reduction="sum") / count
    ref_h, ref_w = torch.autograd.grad(ref, (h, w))
    got = chunked_loss_sum(h, w, t, chunks) / count
    got_h, got_w = torch.autograd.grad(got, (h, w))
    assert abs(got.item() - ref.item()) <= 1e-6
    assert (got_h - ref_h).abs().max() <= 1e-6 and (got_w - ref_w).abs().max() <= 1e-6


def _model(name: str, **kw):
    spec = preset(name, n_layers=2, vocab_size=211, **kw)
    model = build_model(spec)
    init_weights(model, 0)
    return model


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny"])  # gpt2-tiny: a tied head
@pytest.mark.parametrize("packed", [False, True])
def test_the_model_loss_and_every_gradient_match(name, packed):
    g = torch.Generator().manual_seed(0)
    b, s = 2, 45
    tokens = torch.randint(0, 211, (b, s), generator=g)
    if packed:  # two records in the first row, one in the second (models/packing.py)
        records = torch.tensor([[1] * 20 + [2] * 25, [1] * 40 + [0] * 5])
        tokens = torch.stack([tokens, records], 1)
    targets = _targets(b, s, 211, g)
    model = _model(name)
    count = int((targets != -100).sum())
    ref = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="sum") / count
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    for chunks in (2, 7, 90):  # 90 = b·s: one token per chunk
        model.zero_grad()
        loss = model(tokens, targets=targets, loss_chunks=chunks) / count
        loss.backward()
        assert abs(loss.item() - ref.item()) <= 1e-6, chunks
        diff = max((p.grad - want[n]).abs().max().item() for n, p in model.named_parameters())
        assert diff <= 1e-6, (chunks, diff)


def test_bf16_stays_close():
    """Mixed precision: the logits in bf16 as the plain head makes them, the loss in fp32."""
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 211, (2, 33), generator=g), _targets(2, 33, 211, g)
    model = _model("tiny").to(torch.bfloat16)
    ref = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten(), reduction="sum")
    ref.backward()
    want = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = model(tokens, targets=targets, loss_chunks=5)
    loss.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) <= 1e-3 * ref.item()
    for n, p in model.named_parameters():
        scale = want[n].abs().max().item() + 1e-6
        assert (p.grad.float() - want[n]).abs().max().item() <= 0.05 * scale, n


PP2 = ["--parallel.pp=2", "--train.micro_batch=1"]  # 1F1B, the loss on the last stage


@pytest.mark.parametrize("nproc,layout", [(1, []), (2, ["--parallel.zero=3"]), (2, PP2)])
def test_training_runs_match_the_full_logits_loss(nproc, layout):
    steps = ["--train.steps=4", "--train.global_batch=4"]
    plain, chunked = run_cases(
        nproc,
        [case(*layout, *steps), case(*layout, *steps, "--train.loss_chunks=5")],
    )
    for got, ref in zip(chunked, plain, strict=True):
        assert "error" not in got, got.get("error")
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)) <= 1e-6
        assert max_param_diff(got["params"], ref["params"]) <= 1e-6
        if layout == PP2:  # (the first stage's four micro-batches in flight hold more)
            continue
        # saved: no fp32 log-softmax [tokens, vocab] nor flattened targets; the head's weight
        # gradient [vocab, dim] instead (at this small size, larger than the logits)
        tokens, vocab, dim = 32 * 4 // nproc, 512, preset("tiny").dim
        got_act = got["records"][-1]["mem_bytes"]["activations"]
        ref_act = ref["records"][-1]["mem_bytes"]["activations"]
        assert ref_act - got_act == 4 * tokens * vocab + 8 * tokens + 4 - 4 * vocab * dim


VOCAB, SEQ = 32768, 4096


def _measured(chunks: int) -> int:
    spec = preset("tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64)
    spec = spec.__class__(**{**spec.__dict__, "vocab_size": VOCAB, "max_seq_len": SEQ})
    model = build_model(spec)
    init_weights(model, 0)
    meter = ActivationMeter(model)
    window = torch.randint(0, VOCAB, (1, SEQ + 1))  # as the loader: views of one window
    inputs, targets = window[:, :-1], window[:, 1:]
    with meter.measure():
        if chunks > 1:
            model(inputs, targets=targets, loss_chunks=chunks)
        else:
            logits = model(inputs)
            F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")
    return meter.take_peak(), spec


def test_saved_activations_drop_by_the_logits_as_predicted():
    full, _ = _measured(0)
    chunked, spec = _measured(8)
    logits = 4 * SEQ * VOCAB  # the fp32 log-softmax the full loss saves
    assert full - chunked >= logits - VOCAB * spec.dim * 4  # minus the saved weight gradient
    assert chunked < full / 10
    hw = get_hardware("cpu", calibrate=False)
    for chunks, measured in ((0, full), (8, chunked)):
        job = Job(spec, hw, 1, seq_len=SEQ, global_batch=1, precision="fp32", loss_chunks=chunks)
        predicted = predict_memory(job, Layout(micro_batch=1))["activations"]
        assert abs(predicted - measured) <= 0.05 * measured, (chunks, predicted, measured)


def test_explain_prices_the_chunked_loss():
    """`shardwise explain`'s activations: the config's loss_chunks reaches the planner."""
    from shardwise.job.explain import explain_record

    base = [*case()["overrides"], "--train.micro_batch=8"]
    hw = get_hardware("cpu", calibrate=False)
    plain = explain_record(load_config(None, base), 1, hw)["mem_bytes"]["activations"]
    cfg = load_config(None, [*base, "--train.loss_chunks=4"])
    chunked = explain_record(cfg, 1, hw)["mem_bytes"]["activations"]
    s, b, v, d = 32, 8, 512, cfg.model.dim or preset("tiny").dim
    # the fp32 log-softmax and flattened targets go; the head's weight gradient comes
    assert plain - chunked == 4 * s * b * v + 8 * s * b + 4 - 4 * v * d


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--parallel.tp=2"], ["train.loss_chunks=4", "parallel.tp=2", "--parallel.tp=1"]),
        (["--model.name=hf-gpt2-tiny"], ["model.name='hf-gpt2-tiny'", "loss_chunks=0"]),
        (["--train.loss=os.path:join"], ["train.loss='os.path:join'", "loss_chunks=0"]),
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=zb", "--train.micro_batch=1"],
            ["pp_schedule=zb", "--parallel.pp_schedule=1f1b"],
        ),
        (["--finetune.lora_rank=4", "--finetune.lora_targets=wq,head"], ["'head'"]),
        (["--precision.compute=fp16"], ["precision.compute=fp16", "--precision.compute=bf16"]),
    ],
)
def test_refused_where_it_does_not_apply(extra, needles):
    cfg = load_config(None, [*case()["overrides"], "--train.loss_chunks=4", *extra])
    with pytest.raises(ConfigError) as err:
        derive(cfg, 2)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_a_classifier_is_refused():
    cfg = load_config(
        None, ["--model.name=resnet18", "--data.dataset=digits", "--train.loss_chunks=2"]
    )
    with pytest.raises(ConfigError, match=r"a ResNet.*--train\.loss_chunks=0"):
        derive(cfg, 1)


def test_off_by_default_and_negative_refused():
    assert load_config(None, []).train.loss_chunks == 0
    cfg = load_config(None, ["--train.loss_chunks=-1"])
    with pytest.raises(ConfigError, match=r"train\.loss_chunks=-1"):
        derive(cfg, 1)


def test_evaluation_never_holds_the_full_logits_either(tmp_path, monkeypatch):
    """The held-out loss goes through the chunked head too (a job that needs the chunks to fit
    would otherwise run out of memory at its first evaluation, the logits of a rank's whole
    share of the batch alive at once), and equals the full-logits held-out loss."""
    from shardwise.launchers.harness import run_here
    from shardwise.models.chunked_loss import LMHead

    calls, forward = [], LMHead.forward

    def spy(self, x, targets=None, chunks=0):
        calls.append((targets is not None, torch.is_grad_enabled()))
        return forward(self, x, targets, chunks)

    monkeypatch.setattr(LMHead, "forward", spy)
    steps = ["--train.steps=2", "--train.global_batch=4", "--train.eval_every=2"]
    steps += ["--data.val_fraction=0.1", "--train.eval_batches=1"]
    chunked = run_here(case(*steps, "--train.loss_chunks=3"), str(tmp_path / "chunked"))
    assert (True, False) in calls and (False, False) not in calls, calls  # eval: chunked
    plain = run_here(case(*steps), str(tmp_path / "plain"))
    ours, ref = chunked["records"][-1], plain["records"][-1]
    assert "eval_loss" in ref, ref
    assert abs(ours["eval_loss"] - ref["eval_loss"]) <= 1e-6
