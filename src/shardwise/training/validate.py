"""Cross-field checks and derived values. Runs before any process group starts.

Every message names the offending values, prints every factor of a failed product, and says
the fix (STYLE.md rule 8)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.config import Config
from shardwise.distributed.topology import degrees
from shardwise.errors import ConfigError
from shardwise.models import ModelSpec
from shardwise.models.families import Family, family_of
from shardwise.models.spec import spec_from_config
from shardwise.parallel.expert import check_expert_parallel
from shardwise.parallel.fp8 import check_fp8
from shardwise.training.checks import (
    check_compile,
    check_lora,
    check_loss,
    check_loss_chunks,
    check_packing,
)
from shardwise.training.checks_layout import (
    check_checkpoint_tp,
    check_context_parallel,
    check_pipeline,
    check_tensor_parallel,
)


@dataclass(frozen=True)
class Derived:
    world: int
    pp: int
    dp: int
    tp: int
    micro_batch: int
    micro_batches: int  # per rank per step (gradient accumulation steps)
    tokens_per_sample: int
    spec: ModelSpec
    family: Family  # what the model's family answers (models/families/), resolved once
    cp: int = 1  # ranks splitting each sample's sequence; dp counts the sample streams
    ep: int = 1  # ranks splitting each MoE layer's experts (parallel/expert.py)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.micro_batches * self.dp * self.tokens_per_sample


def model_spec(cfg: Config) -> ModelSpec:
    """The model the config names (models.spec.spec_from_config), checked against the
    sequence length and tensor parallelism it will run with."""
    return resolve_model(cfg)[0]


def resolve_model(cfg: Config) -> tuple[ModelSpec, Family]:
    """The model the config names and its family (resolved here once per job), the spec
    checked against the sequence length and tensor parallelism it will run with."""
    spec = spec_from_config(cfg)
    family = family_of(spec)
    if family.sized:
        _check_transformer(spec, family, cfg)
    return spec, family


def _check_transformer(spec: ModelSpec, family: Family, cfg: Config) -> None:
    if spec.dim % spec.n_heads and not spec.head_dim_override:  # (a set width needs none)
        raise ConfigError(
            f"model.dim={spec.dim} is not divisible by model.n_heads="
            f"{spec.n_heads}. Fix: pick n_heads dividing dim, or set --model.head_dim."
        )
    if spec.n_kv_heads and spec.n_heads % spec.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={spec.n_heads} is not divisible by model.n_kv_heads="
            f"{spec.n_kv_heads}. Fix: n_kv_heads must divide n_heads."
        )
    check_tensor_parallel(spec, family, cfg)
    if cfg.data.seq_len > spec.max_seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len="
            f"{spec.max_seq_len}. Fix: --data.seq_len={spec.max_seq_len} or less."
        )


def _positive(cfg: Config) -> None:
    checks = {
        "train.steps": cfg.train.steps,
        "train.global_batch": cfg.train.global_batch,
        "data.seq_len": cfg.data.seq_len,
        "train.lr": cfg.train.lr,
        "parallel.bucket_mb": cfg.parallel.bucket_mb,
        "parallel.timeout_s": cfg.parallel.timeout_s,
        "log.every": cfg.log.every,
        "data.image_size": cfg.data.image_size,
        "precision.scale_window": cfg.precision.scale_window,
        "precision.loss_scale": cfg.precision.loss_scale,
        "optim.eps": cfg.optim.eps,
        "checkpoint.keep": cfg.checkpoint.keep,
        "profile.max_events": cfg.profile.max_events,
        "memory.nvme_buffer_mb": cfg.memory.nvme_buffer_mb,
    }
    for key, value in checks.items():
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive. Fix: --{key}=<a value > 0>.")
    nonneg = {
        "train.micro_batch": cfg.train.micro_batch,
        "optim.grad_clip": cfg.optim.grad_clip,
        "optim.warmup_steps": cfg.optim.warmup_steps,
        "train.eval_every": cfg.train.eval_every,
        "train.eval_batches": cfg.train.eval_batches,
        "optim.weight_decay": cfg.optim.weight_decay,
        "checkpoint.every": cfg.checkpoint.every,
        "train.max_skipped_steps": cfg.train.max_skipped_steps,
        "data.prefetch": cfg.data.prefetch,
        "data.max_bad_rows": cfg.data.max_bad_rows,
        "profile.steps": cfg.profile.steps,
        "profile.warmup": cfg.profile.warmup,
    }
    for key, value in nonneg.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative. Fix: --{key}=0 or more.")
    if not 0 <= cfg.data.val_fraction < 1:
        raise ConfigError(
            f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1). Fix: e.g. "
            "--data.val_fraction=0.02"
        )
    for key, value, example in (
        ("optim.beta1", cfg.optim.beta1, 0.9),
        ("optim.beta2", cfg.optim.beta2, 0.95),
    ):
        if not 0 <= value < 1:
            raise ConfigError(f"{key}={value} must be in [0, 1). Fix: e.g. --{key}={example}")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError(
            f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be in [0, 1]. Fix: e.g. "
            "--optim.min_lr_ratio=0.1"
        )


def _checkpoint(cfg: Config) -> None:
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not Path(resume).is_dir():
        raise ConfigError(
            f"checkpoint.resume='{resume}' is neither auto, none nor an existing checkpoint "
            "directory. Fix: --checkpoint.resume=auto (the newest valid checkpoint in "
            "checkpoint.dir) or the path of a step-NNNNNNNN directory."
        )


def _check_compression(cfg: Config) -> None:
    p, kind = cfg.parallel, cfg.parallel.grad_compression
    if kind == "none":
        return
    if p.zero and kind == "powersgd":
        raise ConfigError(
            f"parallel.grad_compression=powersgd sums low-rank factors of whole gradient "
            f"matrices, and parallel.zero={p.zero} reduce-scatters each rank's slice of them "
            "instead (no rank holds a whole matrix to factor). Fix: --parallel.zero=0, or "
            "--parallel.grad_compression=bf16 (a 16-bit reduce-scatter)."
        )
    if cfg.precision.reduce != "fp32":
        raise ConfigError(
            f"parallel.grad_compression={kind} keeps fp32 gradient buffers and compresses "
            f"only what is sent, but precision.reduce={cfg.precision.reduce} makes the buffers "
            f"{cfg.precision.reduce} already. Fix: --precision.reduce=fp32."
        )
    if kind == "powersgd" and p.powersgd_rank < 1:
        raise ConfigError(
            f"parallel.powersgd_rank={p.powersgd_rank} must be >= 1. Fix: e.g. "
            "--parallel.powersgd_rank=4"
        )
    if kind == "powersgd" and cfg.precision.compute == "fp16":
        raise ConfigError(
            "parallel.grad_compression=powersgd keeps an error memory across steps, and "
            "precision.compute=fp16 scales the gradients by a loss scale that changes (and "
            "skips steps). Fix: --precision.compute=bf16 or fp32."
        )


def _check_memory(cfg: Config) -> None:
    """parallel.zero, pp_virtual and memory.offload: each valid, and the offload one that the
    ZeRO stage and optimizer can hold."""
    p = cfg.parallel
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError(
            f"parallel.zero={p.zero} must be 0, 1, 2 or 3. Fix: e.g. --parallel.zero=0"
        )
    if p.pp_virtual < 1:
        raise ConfigError(
            f"parallel.pp_virtual={p.pp_virtual} must be >= 1. Fix: --parallel.pp_virtual=1"
        )
    if cfg.memory.offload != "none" and p.zero == 0:
        raise ConfigError(
            f"memory.offload='{cfg.memory.offload}' needs sharded optimizer state: "
            "parallel.zero=0. Fix: --parallel.zero=1 (or 2, 3)."
        )
    if cfg.memory.offload.endswith("+nvme") and cfg.optim.name != "adamw":
        raise ConfigError(
            f"memory.offload={cfg.memory.offload} steps torch's fp32 AdamW on disk, and "
            f"optim.name={cfg.optim.name} keeps another state. Fix: --optim.name=adamw, "
            "or --memory.offload=optimizer."
        )
    if cfg.memory.offload == "params+nvme" and p.zero != 3:
        raise ConfigError(
            f"memory.offload='params+nvme' puts ZeRO-3's parameter slices on disk, but "
            f"parallel.zero={p.zero}. Fix: --parallel.zero=3, or --memory.offload=optimizer+nvme."
        )
    if cfg.memory.offload == "optimizer+params" and p.zero != 3:
        raise ConfigError(
            f"memory.offload='optimizer+params' needs parameter sharding, but "
            f"parallel.zero={p.zero}. Fix: --parallel.zero=3, or "
            "--memory.offload=optimizer."
        )


def _degrees(cfg: Config, world: int, spec: ModelSpec, family: Family) -> tuple[int, int, int, int]:
    """(pp, dp, cp, tp) of `world` ranks, dp counting the sample streams (world / (tp·pp·cp)),
    after the checks that need the degrees of the mesh."""
    p = cfg.parallel
    pp, dp, tp = degrees(world, p.tp, p.pp)
    cp = p.cp
    check_context_parallel(cfg, spec, family, tp, pp)
    check_expert_parallel(cfg, spec, family, dp)
    if dp % cp:  # the topology's dp (every rank sharing the parameters) is dp x cp here
        raise ConfigError(
            f"world size {world} = pp({pp}) * dp * cp({cp}) * tp({tp}) leaves no whole dp: "
            f"{world} / {pp * cp * tp} = {world / (pp * cp * tp):g}. Fix: a parallel.cp "
            f"dividing world / (tp * pp) = {dp}, or a world size that is a multiple of "
            f"{pp * cp * tp}."
        )
    return pp, dp // cp, cp, tp  # dp: the sample streams the global batch is split over


def _user_data(cfg: Config) -> bool:
    """Whether data.dataset is your own (data/user.py: module:fn, one sample per item)."""
    return ":" in cfg.data.dataset


def _check_model_and_data(cfg: Config, spec: ModelSpec, family: Family, tp: int, pp: int) -> None:
    """What the model family, its loss and options accept at this tp and pp, and whether
    data.dataset and data.format are that model's kind of data."""
    is_image, user_data = family.data == "images", _user_data(cfg)
    check_loss(cfg, tp, pp)
    check_loss_chunks(cfg, family, tp, pp)
    check_compile(cfg, family)
    check_fp8(cfg, spec, family, tp)
    if tp > 1 and family.tp_refusal:
        raise ConfigError(family.tp_refusal.format(tp=tp, name=cfg.model.name))
    check_lora(spec, cfg)
    if family.tensor_parallel == "checkpoint" and tp > 1:
        check_checkpoint_tp(spec, family, cfg)
    if cfg.data.format != "text" and (is_image or user_data or family.classifier):
        what = "a classifier" if family.classifier else f"'{cfg.data.dataset}'"
        raise ConfigError(
            f"data.format={cfg.data.format} builds next-token samples of records for a causal "
            f"language model, and {what} is not one's data. Fix: --data.format=text, or a "
            "causal LM with a .jsonl/.json/.parquet file of records."
        )
    if cfg.data.pack:
        check_packing(cfg, family, pp)
    yours = family.data == "any" or user_data  # the pairing is yours / the checkpoint's
    if not yours and is_image != (cfg.data.dataset == "digits"):
        kind = "an image model" if is_image else "a text model"
        fix = "--data.dataset=digits" if is_image else "--model.name=resnet18"
        raise ConfigError(
            f"model.name='{cfg.model.name}' is {kind} but data.dataset="
            f"'{cfg.data.dataset}' is not its kind of data. Fix: {fix}."
        )


def _batches(cfg: Config, dp: int) -> tuple[int, int]:
    """(micro-batch size, micro-batches per step) splitting train.global_batch over `dp`."""
    t = cfg.train
    if t.global_batch < dp:
        raise ConfigError(
            f"train.global_batch={t.global_batch} < dp({dp}): every data-parallel "
            f"rank needs at least one sample. Fix: --train.global_batch={dp} or "
            "more (dp = world / (tp * pp * cp))."
        )
    micro = t.micro_batch or t.global_batch // dp
    if micro == 0 or t.global_batch % (micro * dp):
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by "
            f"train.micro_batch({micro}) * dp({dp}) = {micro * dp}. Fix: make "
            "global_batch a multiple of micro_batch * dp (dp = world / (tp * pp * cp))."
        )
    return micro, t.global_batch // (micro * dp)


def derive(cfg: Config, world: int) -> Derived:
    """Validate `cfg` for `world` ranks and compute the values every later stage needs."""
    _positive(cfg)
    _check_memory(cfg)
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "run.device='cuda' but no CUDA device is visible. Fix: --run.device=cpu or auto."
        )
    _check_compression(cfg)
    spec, family = resolve_model(cfg)
    pp, dp, cp, tp = _degrees(cfg, world, spec, family)
    _check_model_and_data(cfg, spec, family, tp, pp)
    micro, m = _batches(cfg, dp)
    _checkpoint(cfg)
    check_pipeline(cfg, spec, family, pp, dp, micro, m)
    # a sample is one row (an image, a labelled text, your item) or seq_len tokens
    per_row = cfg.data.dataset == "digits" or _user_data(cfg) or family.classifier
    tokens = 1 if per_row else cfg.data.seq_len
    return Derived(world, pp, dp, tp, micro, m, tokens, spec, family, cp, cfg.parallel.ep)


def check_held_out(cfg: Config, derived: Derived, held_out) -> None:
    """Evaluation reads at least one held-out sample per data-parallel rank: checked once the
    data is prepared (before launch), not at the first evaluation hours in."""
    if held_out is None or not cfg.train.eval_batches or len(held_out) >= derived.dp:
        return
    raise ConfigError(
        f"the held-out split of data.dataset='{cfg.data.dataset}' has {len(held_out)} samples, "
        f"fewer than the {derived.dp} data-parallel ranks that evaluate it. Fix: a larger "
        "data.val_fraction, more data, or --train.eval_batches=0 (no evaluation)."
    )
