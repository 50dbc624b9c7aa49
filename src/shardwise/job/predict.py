"""The planner's prediction for one given config (used by `explain` and `train --plan auto`).

Our decoders are priced by formula (plan/search.evaluate). Models without one are measured
on the real model built on fake tensors (job/fake.py): model states from its ZeRO units (so
frozen parameters, tied weights and image models are exact), activations from one forward
under the engine's own saved-tensor accounting, in one stage (job/measured.py) or cut into
pipeline stages (job/stages.py). The config -> description mapping is job/describe.py.
"""

from __future__ import annotations

import dataclasses

from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise.config import Config
from shardwise.finetune.quant import quant_layers
from shardwise.job.describe import job_from_config, layout_from_config
from shardwise.job.experts import expert_units
from shardwise.job.fake import (
    UnmeasuredForward,
    fake_activations,
    local_config,
    measure_activations,
    meta_model,
    model_units,
    real_model,
    split_tp,
    tied_first,
    to_fake,
)
from shardwise.job.measured import predict_measured
from shardwise.job.stages import predict_stages
from shardwise.models import count_params
from shardwise.plan.hardware import Hardware
from shardwise.plan.search import evaluate
from shardwise.plan.valid import check_some_blocks
from shardwise.training.memory import tensor_bytes

# the names other modules import from here: the prediction and the inputs it is made of
__all__ = [
    "job_from_config",
    "layout_from_config",
    "measure_activations",
    "model_units",
    "predict_config",
    "real_model",
]


def predict_config(cfg: Config, derived, hardware: Hardware) -> tuple[int, dict]:
    """(parameter count, the planner's candidate record for exactly this config)."""
    job = job_from_config(cfg, hardware, derived.world, derived.spec)
    layout = layout_from_config(cfg, derived)
    check_some_blocks(job, layout, cfg.finetune.lora_targets)
    formula = derived.family.formula  # our blocks: activations by formula
    model = meta_model(cfg, derived.spec)  # as training builds it
    n = count_params(model)
    quantised = [m.shape for _, m in quant_layers(model)]
    tp = None
    if not formula:  # a real model's units and fake forward: rank 0's tp shard of it
        tp = split_tp(model, cfg, derived)
    us = model_units(model)
    dense, experts = expert_units(model, layout.ep) if layout.ep > 1 else (us, [])
    if quantised:  # the NF4 base: bitsandbytes' bytes per layer, outside the ZeRO units
        n += sum(a * b for a, b in quantised)
        job = dataclasses.replace(job, quantised_shapes=tuple(quantised))
    activations, unmeasured = 0, None
    with FakeTensorMode():
        to_fake(model)
        module_buffers = tensor_bytes(model.buffers())
        # the whole model's saved bytes (a pipeline measures each stage below), and which
        # quantised linears backward uses
        if (not formula and layout.pp == 1) or quantised:  # (cp > 1: at the local length)
            try:
                activations = fake_activations(model, local_config(cfg, layout.cp), derived, tp=tp)
            except UnmeasuredForward as exc:  # priced without them, and said (job/explain.py)
                unmeasured = exc.where
    if quantised:
        backward = tuple(m.input_needs_grad for _, m in quant_layers(model))
        job = dataclasses.replace(job, quantised_backward=backward)
    if not formula:  # whether a head gathers the embedding's unit again: the real module's
        # sharing, not the config's flag (a BERT classifier's config ties; it has no LM head)
        spec = dataclasses.replace(job.spec, tie_embeddings=tied_first(model))
        job = dataclasses.replace(job, spec=spec)
    if not formula and layout.pp > 1:  # a Hugging Face causal LM or MoE decoder in stages
        return n, predict_stages(cfg, derived, job, layout, model)
    if not formula:  # states + the fake forward's bytes (unsharded models only)
        units = (us, dense, experts)
        pred = predict_measured(job, layout, model, units, activations, module_buffers)
        return n, pred if unmeasured is None else {**pred, "activations_unmeasured": unmeasured}
    if layout.pp == 1 and layout.tp == 1:  # the real model's units: frozen parameters exact
        job = dataclasses.replace(job, frozen=tuple(us))
    return n, evaluate(job, layout)
