"""The checks `derive` runs that depend on the model and the training options together: the
loss, its chunks, compilation, LoRA and a quantised base, and packed rows (training/validate.py
calls them before launch; the parallel layout's are in checks_layout.py)."""

from __future__ import annotations

import fnmatch

from shardwise.config import Config, FinetuneConfig
from shardwise.errors import ConfigError
from shardwise.models import ModelSpec
from shardwise.models.families import Family
from shardwise.parallel.compile import untraced


def check_packing(cfg: Config, family: Family, pp: int) -> None:
    """data.pack=true: records in rows, attention masked per record by the model."""
    why = ""
    if cfg.data.format == "text":
        why = (
            "text data is one stream of documents cut into data.seq_len windows already. "
            "Fix: --data.format=instruction (or chat) for records, or --data.pack=false."
        )
    elif not family.packs_rows:
        why = (
            f"model.name='{cfg.model.name}' takes [B, S] ids; packed rows need a model that masks "
            "attention per record (the built-in decoders and Hugging Face causal LMs do). "
            "Fix: --data.pack=false."
        )
    elif pp > 1:
        why = (
            f"with parallel.pp={pp} the later stages receive hidden states, not the record "
            "numbers their attention masks need. Fix: --parallel.pp=1, or --data.pack=false."
        )
    if why:
        raise ConfigError(f"data.pack=true packs instruction/chat records into rows, but {why}")


def check_loss(cfg: Config, tp: int, pp: int) -> None:
    if cfg.train.loss == "cross_entropy":
        return
    if ":" not in cfg.train.loss:
        raise ConfigError(
            f"train.loss='{cfg.train.loss}' is neither cross_entropy nor module:fn. Fix: "
            "--train.loss=cross_entropy, or your function as mylosses:mse or losses.py:mse."
        )
    from shardwise.data.callables import resolve

    resolve(cfg.train.loss, "train.loss")  # imports, or one message naming what failed
    if tp > 1 or pp > 1:
        raise ConfigError(
            f"train.loss='{cfg.train.loss}' with parallel.tp={tp}, parallel.pp={pp}: your loss "
            "sees whole outputs, which tensor and pipeline parallelism split. Fix: "
            "--parallel.tp=1 --parallel.pp=1 (data parallelism and ZeRO keep them whole)."
        )


def check_compile(cfg: Config, family: Family) -> None:
    """train.compile=blocks: the families and layouts whose compiled blocks are tested."""
    if cfg.train.compile == "false":
        return
    if why := compile_refusal(cfg, family):
        fix = "" if "Fix:" in why else " Fix: --train.compile=false."
        raise ConfigError(f"train.compile={cfg.train.compile}: {why}.{fix}")


def compile_refusal(cfg: Config, family: Family) -> str:
    """Why this job's blocks cannot be compiled ("" when train.compile=blocks would run)."""
    par = cfg.parallel
    case = untraced(family, cfg.memory.recompute, par.pp, par.pp_schedule, par.cp)
    if case is None:
        return ""
    return {
        "a model family that does not compile them": (
            f"model.name='{cfg.model.name}' is {family.kind}, whose compiled blocks are not "
            "tested yet (the built-in decoders and the hf-* presets are)"
        ),
        "selective recompute": (
            "memory.recompute=selective recomputes parts inside each block, and torch.compile "
            "cannot trace that recomputation. Fix: --memory.recompute=full (it wraps the "
            "compiled block) or none"
        ),
        "the zb schedule": (
            "parallel.pp_schedule=zb splits each linear layer's backward in two, untraced"
        ),
        "cp": f"parallel.cp={par.cp} attends with communicating kernels, untraced",
    }[case]  # every case of the shared rule has its message here


def check_loss_chunk_count(n: int) -> None:
    """train.loss_chunks is a count: 0 (or 1) off, more the chunks (plan and explain check it
    too, before any layout)."""
    if n < 0:
        raise ConfigError(f"train.loss_chunks={n} must be >= 0. Fix: e.g. 8, or 0 for off.")


def check_loss_chunks(cfg: Config, family: Family, tp: int, pp: int) -> None:
    """train.loss_chunks > 1: the built-in decoders' head computes the loss in chunks."""
    n = cfg.train.loss_chunks
    check_loss_chunk_count(n)
    if n <= 1:
        return
    why = ""
    lora_head = cfg.finetune.lora_rank and any(
        p.strip() == "head" or fnmatch.fnmatchcase("head", p.strip())
        for p in cfg.finetune.lora_targets.split(",")
    )
    if not family.chunked_loss:
        why = (
            f"model.name='{cfg.model.name}' is {family.kind}, whose head and loss are not "
            "ours to split. Fix: --train.loss_chunks=0 (or a built-in decoder)."
        )
    elif cfg.train.loss != "cross_entropy":
        why = f"train.loss='{cfg.train.loss}' needs whole logits. Fix: --train.loss_chunks=0."
    elif tp > 1:
        why = (
            f"parallel.tp={tp} splits the vocabulary and its loss over tp ranks (already 1/tp "
            "of the logits each). Fix: --train.loss_chunks=0, or --parallel.tp=1."
        )
    elif pp > 1 and cfg.parallel.pp_schedule == "zb":
        why = (
            "parallel.pp_schedule=zb defers weight gradients to a later pass, and the chunked "
            "loss makes the head's in its forward. Fix: --train.loss_chunks=0, or "
            "--parallel.pp_schedule=1f1b."
        )
    elif cfg.precision.compute == "fp16":
        why = (
            "precision.compute=fp16 would hold the head's weight gradient, summed over the "
            "micro-batch's tokens, in fp16 before the loss scale divides it: it can overflow. "
            "Fix: --precision.compute=bf16 (or fp32), or --train.loss_chunks=0."
        )
    elif lora_head:
        why = (
            "finetune.lora_targets puts an adapter on 'head'. Fix: --train.loss_chunks=0, or "
            "leave 'head' out of the targets."
        )
    if why:
        raise ConfigError(f"train.loss_chunks={n} computes the head and loss in chunks, but {why}")


def check_lora(spec: ModelSpec, cfg: Config) -> None:
    """LoRA's keys, and its targets must name linear layers of this model (applied on meta
    before launch)."""
    from shardwise.finetune import build_adapted
    from shardwise.finetune.lora import check
    from shardwise.models.expert_lora import adapted_weights

    check(cfg.finetune)
    quant = cfg.finetune.base_quant
    if quant != "none" and cfg.finetune.lora_rank == 0:
        raise ConfigError(
            f"finetune.base_quant={quant} freezes a quantised base under LoRA adapters, and "
            "finetune.lora_rank=0 trains none. Fix: --finetune.lora_rank=16 (QLoRA)."
        )
    if cfg.finetune.lora_rank == 0:
        check_no_lora_keys(cfg.finetune)
        return
    model = build_adapted(spec, cfg.finetune)[0]
    p = cfg.parallel
    if (p.tp > 1 or p.pp > 1) and adapted_weights(model):  # (models/expert_lora.py)
        raise ConfigError(
            f"finetune.lora_targets='{cfg.finetune.lora_targets}' adapts stacked expert "
            f"weights, which are not checked with parallel.tp={p.tp} or parallel.pp={p.pp} "
            "yet. Fix: --parallel.tp=1 --parallel.pp=1 (data, ZeRO and expert parallelism "
            "run), or leave the experts out of the targets."
        )


def check_no_lora_keys(ft: FinetuneConfig) -> None:
    """Without adapters (lora_rank=0) LoRA's other keys have nothing to shape: a value the
    user set there would be ignored, so it is refused instead."""
    off = FinetuneConfig()
    for key in ("lora_targets", "lora_alpha", "lora_dropout"):
        value = getattr(ft, key)
        if value != getattr(off, key):
            raise ConfigError(
                f"finetune.{key}={value!r} shapes LoRA adapters, and finetune.lora_rank=0 adds "
                f"none, so it would be ignored. Fix: --finetune.lora_rank=16 (LoRA), or leave "
                f"finetune.{key} at its default ({getattr(off, key)!r})."
            )
