"""`plan --model config.json` for a Hugging Face family whose blocks are not ours: the planner
reads its real modules instead of a formula.

The model is built from the config on the meta device (transformers' own class, no weights),
adapted as `train` would (LoRA, a quantised base, frozen parameters); its ZeRO units give the
model states of every layout exactly, as they do for `explain`. Activations come from fake
forwards (the engine's saved-tensor meter, job/predict.py) at one and two samples per
micro-batch, per recomputation mode: a transformer's saved bytes are an intercept plus a
slope in the micro-batch (every tensor is per sample, or a constant such as the rotary
tables), so the two points give every micro-batch size. The matmul FLOPs count the real
non-embedding parameters. Tensor and pipeline parallelism are searched for the families
the formula models (Llama-family, GPT-2) only: for these, the search keeps tp = pp = 1.
"""

from __future__ import annotations

import dataclasses

from shardwise.errors import ConfigError
from shardwise.job.predict import measure_activations, real_model
from shardwise.plan.layout import Job


def real_job(job: Job, cfg) -> Job:
    """`job` with the real model's units, module buffers, matmul parameters and activation
    lines (intercept, slope per sample) per recomputation mode."""
    units, buffers, matmul, tied = real_model(cfg, job.spec)
    spec = dataclasses.replace(job.spec, tie_embeddings=tied)  # a tied head's second gathers
    lines = []
    for mode in ("none", "selective", "full"):
        try:
            one, two = (measure_activations(cfg, job.spec, mode, b) for b in (1, 2))
        except ConfigError:  # a mode this family does not have (selective: ours only)
            continue
        lines.append((mode, (2 * one - two, two - one)))
    return dataclasses.replace(
        job,
        spec=spec,
        frozen=tuple(units),
        buffer_bytes=buffers,
        matmul_params=matmul,
        act_lines=tuple(lines),
    )
