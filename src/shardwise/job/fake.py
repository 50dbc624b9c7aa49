"""The real model as training builds it, on meta and fake tensors, for the planner's measured
path: its ZeRO units (so frozen parameters, tied weights and image models are exact), tp rank
0's shard of it, and the bytes one micro-batch's forward and loss save for backward under the
engine's own saved-tensor accounting (training/memory.ActivationMeter)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from shardwise.config import Config
from shardwise.data.callables import resolve
from shardwise.distributed import device as dev
from shardwise.distributed.frames import in_torch
from shardwise.errors import ConfigError
from shardwise.finetune import build_adapted
from shardwise.finetune.quant import quant_layers
from shardwise.models.dropout import random_stream, samples
from shardwise.parallel.recompute import apply_recompute
from shardwise.parallel.sync_batchnorm import apply_sync_batchnorm
from shardwise.parallel.tensor import keep_tp_marks
from shardwise.parallel.zero_units import unit_roots
from shardwise.plan.shapes import Unit, split_trainable
from shardwise.training.memory import ActivationMeter
from shardwise.training.parallelize import cast_for_compute
from shardwise.training.runtime import freeze


def model_units(model: torch.nn.Module) -> list[Unit]:
    """The engine's ZeRO units of a real (meta or fake) model as planner units (trainable and
    frozen parameters apart, as the engine keeps them)."""
    return split_trainable(
        [
            Unit(name, tuple((p.numel(), p.requires_grad, tuple(p.shape)) for *_, p in entries))
            for name, entries, _ in unit_roots(model)
        ]
    )


def to_fake(model: torch.nn.Module) -> None:
    """Meta parameters and buffers -> fake tensors of the active FakeTensorMode, assigned in
    place (Module.to_empty would swap them, which fake tensors refuse); a tied weight once.
    A quantised linear holds no codes here: it multiplies by a weight of its shape only."""
    for _, layer in quant_layers(model):
        layer.shape_only = True
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for key, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    new = torch.empty(t.shape, dtype=t.dtype)
                    if isinstance(t, torch.nn.Parameter):  # keep tp's marks: job/experts.py
                        # reads which gradients are summed over tp (`partial`)
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                        new = keep_tp_marks(t, new)
                    done[id(t)] = new
                store[key] = done[id(t)]


@contextlib.contextmanager
def as_in_training() -> Iterator[None]:
    """transformers reads the position ids' values to tell packed rows from plain ones, and
    on fake tensors, which have none, assumes packing: an explicit mask (and repeated k/v
    heads instead of SDPA's GQA) that the real run does not save. The rows this forward
    feeds are plain (a packed run passes its own mask), so answer as the real run does."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def meta_model(cfg: Config, spec) -> torch.nn.Module:
    """The model on meta as training builds it: adapters added, the base quantised, frozen."""
    model = build_adapted(spec, cfg.finetune)[0]
    freeze(model, cfg.train.freeze)
    return model


class _PlanTopology:
    def __init__(self, tp: int) -> None:
        self.tp = tp

    def size(self, dim: str) -> int:
        return self.tp if dim == "tp" else 1

    def coord(self, dim: str) -> int:
        return 0


class PlanComm:
    """A tp group of `tp` ranks for the planner's meta and fake models: the sharder reads its
    size and this rank's place (rank 0); the collectives of a fake forward leave their
    outputs as allocated (fake tensors hold no values, only shapes)."""

    def __init__(self, tp: int) -> None:
        self.topo = _PlanTopology(tp)

    def all_reduce(self, *args, **kwargs) -> None:
        return None

    all_gather = reduce_scatter = all_reduce


def split_tp(model: torch.nn.Module, cfg: Config, derived):
    """Cut the meta model to tp rank 0's shard of every planned layer, as training does
    (parallel/tensor.apply_tensor_parallel with the model's published plan); returns the
    transformation (its loss: vocabulary-parallel when the head is split), None at tp = 1."""
    if derived.tp == 1:
        return None
    from shardwise.models.tp_plans import plan_for
    from shardwise.parallel.tensor import apply_tensor_parallel

    plan = plan_for(model, derived.spec.arch)
    return apply_tensor_parallel(model, PlanComm(derived.tp), plan, cfg.parallel.sp)


def loss_sum(tp, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed loss as training computes it (runtime.Run.loss_sum): the tp shard's own."""
    if tp is not None:
        return tp.loss_sum(logits, targets)
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")


def tied_first(model: torch.nn.Module) -> bool:
    """Whether another root module uses the first ZeRO unit's parameters (a tied head)."""
    roots = unit_roots(model)
    return bool(roots) and len(roots[0][2]) > 1


def real_model(cfg: Config, spec) -> tuple[list, int, int, bool]:
    """(ZeRO units, module buffer bytes, matmul parameters, whether its head is tied to the
    embedding) of `spec`'s real model (job/real.py): every parameter but lookup tables
    costs matmul FLOPs."""
    model = meta_model(cfg, spec)
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lookups -= {id(head.weight)} if head is not None else set()
    matmul = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return model_units(model), buffers, matmul, tied_first(model)


def measure_activations(cfg: Config, spec, recompute: str, micro_batch: int) -> int:
    """Saved bytes of one micro-batch of `micro_batch` samples on `spec`'s real model."""
    from shardwise.models.families import family_of
    from shardwise.training.validate import Derived

    derived = Derived(1, 1, 1, 1, micro_batch, 1, cfg.data.seq_len, spec, family_of(spec))
    model = meta_model(cfg, spec)
    with FakeTensorMode():
        to_fake(model)
        return fake_activations(model, cfg, derived, recompute)


def as_trained(model, cfg: Config, derived, recompute: str) -> None:
    """The forward transformations training applies to the model (training/parallelize.py, same
    order): recomputation, then BatchNorm over every dp replica whenever
    `model.sync_batchnorm` is on (any world size: at dp = 1 its arithmetic is the same), whose
    fp32 statistics save more for backward than torch's fused BatchNorm; then the compute
    dtype. A fake BatchNorm skips its running-statistics update: it reads the global count's
    value (which fake tensors do not have) and, under no_grad, saves nothing for backward."""
    apply_recompute(model, derived.family, recompute)
    if cfg.model.sync_batchnorm and apply_sync_batchnorm(model, PlanComm(1)):
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.track_running_stats = False
    cast_for_compute(model, dev.dtype_of(cfg.precision.compute))


def _batch(cfg: Config, derived) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's inputs and targets shaped as the loader makes them."""
    b = derived.micro_batch
    if cfg.data.dataset == "digits":  # images: a ResNet, or your module on images
        size = cfg.data.image_size
        shape = (b, derived.spec.in_channels, size, size)
        inputs = torch.zeros(shape, dtype=dev.dtype_of(cfg.precision.compute))
        targets = torch.zeros(b, dtype=torch.long)
    elif ":" in cfg.data.dataset:  # your dataset (data/user.py): b items shaped as its first
        inputs, targets = _user_batch(cfg.data.dataset, b)
    elif derived.family.classifier:  # ids and attention mask packed, one label each
        inputs = torch.ones(b, 2, cfg.data.seq_len, dtype=torch.long)
        targets = torch.zeros(b, dtype=torch.long)
    elif cfg.data.pack:  # ids and record numbers [b, 2, s], targets apart (models/packing.py)
        inputs = torch.zeros(b, 2, cfg.data.seq_len, dtype=torch.long)
        inputs[:, 1] = 1
        targets = torch.zeros(b, cfg.data.seq_len, dtype=torch.long)
    else:  # token ids and targets: views of one (b, s+1) window, as the loader makes them
        window = torch.zeros(b, cfg.data.seq_len + 1, dtype=torch.long)
        inputs, targets = window[:, :-1], window[:, 1:]
    if inputs.is_floating_point():  # images (and your float inputs) enter in compute dtype
        inputs = inputs.to(dev.dtype_of(cfg.precision.compute))
    return inputs, targets


def fake_activations(model, cfg: Config, derived, recompute: str | None = None, tp=None) -> int:
    """Bytes saved for backward by one micro-batch's forward and loss, on fake tensors (for
    models without a formula: image models and Hugging Face definitions); `tp`: the shard's
    tensor parallelism (`split_tp`)."""
    as_trained(model, cfg, derived, recompute or cfg.memory.recompute)
    meter = ActivationMeter(model)
    inputs, targets = _batch(cfg, derived)
    try:
        # layout-free dropout (LoRA's on transformers' models) draws its masks by (seed,
        # step, sample) as the training loop sets them: the first step's first samples
        stream = random_stream(cfg.train.seed, 0)
        with meter.measure(), as_in_training(), stream, samples(range(inputs.shape[0])):
            logits = model(inputs)
            if cfg.train.loss != "cross_entropy":  # yours, on whole outputs (as Run.loss_sum)
                resolve(cfg.train.loss, "train.loss")(logits, targets)
            else:
                logits = getattr(logits, "logits", logits)  # a Hugging Face output object
                loss_sum(tp, logits, targets)
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise UnmeasuredForward(_reader(exc)) from None
    return meter.take_peak()


class UnmeasuredForward(ConfigError):
    """A forward that reads a tensor's values (`.item()`, a boolean mask, `nonzero`, ...):
    fake tensors hold none, so its activations cannot be measured before launch."""

    def __init__(self, where: str) -> None:
        self.where = where
        super().__init__(
            f"the model's forward reads a tensor's values on the host at {where} (an "
            "`.item()`, `if tensor:`, a boolean mask or `nonzero`): the planner measures "
            "activations on fake tensors, which hold no values. Fix: keep the value on the "
            "device (torch.where, a masked multiply, reading it every few steps outside the "
            "model); a pipeline of such a model cannot be priced."
        )


def _reader(exc: BaseException) -> str:
    """The innermost frame of the traceback outside torch: the line that read the value."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not in_torch(f.filename)]
    if not frames:
        return "an unknown line"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} ({f.line})" if f.line else f"{f.filename}:{f.lineno}"


def local_config(cfg: Config, cp: int) -> Config:
    """`cfg` with the sequence a cp rank holds of each sample (cp = 1: `cfg`)."""
    if cp == 1:
        return cfg
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, seq_len=cfg.data.seq_len // cp)
    )


def _user_batch(source: str, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`b` samples shaped as the first item of your dataset (read for real, outside the fake
    mode the activations are measured in)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from shardwise.data.user import load_user

    with unset_fake_temporarily():
        x, y = load_user(source, "train").get_batch(torch.tensor([0]))
    return torch.zeros(b, *x.shape[1:], dtype=x.dtype), torch.zeros(b, *y.shape[1:], dtype=y.dtype)
