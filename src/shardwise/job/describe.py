"""A train config as the planner's description: the job (model, data, precision, fine-tuning,
hardware) and the layout (plan/layout.py), one source of truth for `explain`, `plan`,
`--plan auto` and the profile's remedies."""

from __future__ import annotations

from shardwise.config import Config
from shardwise.errors import ConfigError
from shardwise.finetune.lora import EXPERTS, is_path_pattern
from shardwise.models.families import family_of
from shardwise.optim import EIGHT_BIT
from shardwise.optim.nvme import chunk_elements
from shardwise.plan.hardware import Hardware
from shardwise.plan.layout import FineTune, Job, Layout
from shardwise.plan.moe import adapted_experts, lora_shapes
from shardwise.plan.shapes import layer_tags, linear_names, lora_tags, module_buffer_bytes


def job_from_config(
    cfg: Config, hardware: Hardware, devices: int, spec=None, finetune: FineTune | None = None
) -> Job:
    """The planner's job of `cfg` on `devices` of `hardware` (its model spec unless given)."""
    from shardwise.training.checks import check_loss_chunk_count
    from shardwise.training.validate import model_spec

    spec = spec or model_spec(cfg)
    check_loss_chunk_count(cfg.train.loss_chunks)  # (derive's check: plan prices it here)
    return Job(
        spec=spec,
        hardware=hardware,
        devices=devices,
        seq_len=cfg.data.seq_len,
        packed=cfg.data.pack,
        loss_chunks=cfg.train.loss_chunks,
        global_batch=cfg.train.global_batch,
        precision=cfg.precision.compute,
        reduce=cfg.precision.reduce,
        fp8=cfg.precision.fp8,
        finetune=finetune or finetune_of(cfg, spec),
        pp_split=cfg.parallel.pp_split,
        bucket_mb=cfg.parallel.bucket_mb,
        powersgd_rank=cfg.parallel.powersgd_rank,
        compressions=tuple(dict.fromkeys(("none", cfg.parallel.grad_compression))),
        nvme_chunk=chunk_elements(cfg.memory.nvme_buffer_mb),
        compiled=cfg.train.compile == "blocks",
        buffer_bytes=module_buffer_bytes(spec),  # transformers' RoPE inv_freq
    )


def finetune_of(cfg: Config, spec) -> FineTune:
    """The planner's fine-tuning inputs from the train config's `finetune.*` keys (one source
    of truth): LoRA's targets as the planner's names of the block linears they match."""
    ft, eight = cfg.finetune, cfg.optim.name in EIGHT_BIT
    if not ft.lora_rank:
        from shardwise.training.checks import check_no_lora_keys

        check_no_lora_keys(ft)  # (derive's check: plan and explain refuse it too)
        return FineTune(base_quant=ft.base_quant, optim_8bit=eight)
    # our decoders (MoE: the router too) and transformers' presets (the formula's blocks)
    shaped = spec.is_transformer or spec.n_experts or family_of(spec).block.transformers
    tags = tuple(lora_shapes(spec)) if shaped else ()
    by_path = bool(family_of(spec).block.linear_paths)  # transformers' module names

    def matched(pat: str) -> tuple[str, ...]:
        """The planner's names of the linears `pat` adapts (in some block)."""
        leaf, path = pat.rpartition(".")[2], is_path_pattern(pat)
        # (an MoE path may name stacked expert weights, which are not linears: by its leaf)
        strict = path and not spec.n_experts
        hits = lora_tags(spec, pat) if by_path else ((leaf,) if leaf in tags and not strict else ())
        return hits or tuple(dict.fromkeys(t for b in layer_tags(spec, [pat]) for t in b))

    pats = [p.strip() for p in ft.lora_targets.split(",") if p.strip()]
    if pats != ["all-linear"] and tags:
        names = linear_names(spec) if by_path else list(tags)
        hits = {pat: matched(pat) for pat in pats}  # each pattern matched once
        for pat in pats:
            if not hits[pat] and pat != EXPERTS:
                raise ConfigError(
                    f"finetune.lora_targets pattern '{pat}' matches no linear layer of the "
                    f"planned model. Fix: some of {', '.join(names)}, or all-linear."
                )
        adapted = {t for found in hits.values() for t in found}
        tags = tuple(t for t in tags if t in adapted)
    # the stacked expert weights `experts` or their names adapt (finetune/lora.expert_targets)
    experts = adapted_experts([p.rpartition(".")[2] for p in pats]) if spec.n_experts else ()
    layers = layer_tags(spec, pats) if pats != ["all-linear"] and shaped else ()
    return FineTune(ft.lora_rank, tags, ft.base_quant, eight, ft.lora_dropout, experts, layers)


def layout_from_config(cfg: Config, derived) -> Layout:
    """The planner's layout of `cfg` as `derived` (training/validate.derive) resolved it."""
    p = cfg.parallel
    return Layout(
        tp=derived.tp,
        pp=derived.pp,
        dp=derived.dp,
        zero=p.zero,
        sp=p.sp,
        pp_schedule=p.pp_schedule,
        pp_virtual=p.pp_virtual,
        micro_batch=derived.micro_batch,
        recompute=cfg.memory.recompute,
        offload=cfg.memory.offload,
        compression=p.grad_compression,
        cp=derived.cp,
        cp_mode=p.cp_mode,
        ep=derived.ep,
    )
