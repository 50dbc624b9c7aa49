"""The checks `derive` runs on the parallel layout against the model: the sizes tensor (and
sequence) parallelism splits, a checkpoint's plan under it, context parallelism, and the
pipeline's options (training/validate.py calls them before launch)."""

from __future__ import annotations

from math import gcd

from shardwise.config import Config
from shardwise.errors import ConfigError
from shardwise.models import ModelSpec, build_on_meta
from shardwise.models.families import Family
from shardwise.parallel.pipeline_split import plan_chunks


def check_checkpoint_tp(spec: ModelSpec, family: Family, cfg: Config) -> None:
    """model.name=hf with tp > 1: the model's published plan, and the sizes it splits."""
    from shardwise.models.tp_plans import checkpoint_plan

    checkpoint_plan(build_on_meta(spec))
    check_tensor_parallel(spec, family, cfg)


def check_pipeline(
    cfg: Config, spec: ModelSpec, family: Family, pp: int, dp: int, micro: int, m: int
) -> None:
    """Pipeline options: only with pp > 1, a transformer, ZeRO <= 1, a schedule that fits m,
    and a split that covers the model (pipeline_split.plan_chunks)."""
    p = cfg.parallel
    if pp == 1:
        _check_no_pipeline_options(cfg)
        return
    _check_pipeline_model(cfg, spec, family, pp)
    _check_pipeline_schedule(cfg, pp, dp, micro, m)
    plan_chunks(spec, pp, p.pp_virtual, p.pp_split, cfg.data.seq_len)


def _check_no_pipeline_options(cfg: Config) -> None:
    """At pp = 1 every pipeline option is at its default (else it would be silently ignored)."""
    p = cfg.parallel
    for key, value, off in (
        ("parallel.pp_schedule", p.pp_schedule, "1f1b"),
        ("parallel.pp_virtual", p.pp_virtual, 1),
        ("parallel.pp_split", p.pp_split, ""),
    ):
        if value != off:
            raise ConfigError(
                f"{key}={value!r} has no effect with parallel.pp=1. Fix: --parallel.pp=2 "
                f"(or more), or leave {key} at its default."
            )


def _check_pipeline_model(cfg: Config, spec: ModelSpec, family: Family, pp: int) -> None:
    """The model and the data loader can be run by a pipeline schedule of `pp` stages."""
    if cfg.data.prefetch:
        raise ConfigError(
            f"data.prefetch={cfg.data.prefetch} loads micro-batches ahead in the plain loop; "
            f"the pipeline schedule (parallel.pp={pp}) loads its own when a stage needs them. "
            "Fix: --data.prefetch=0 with parallel.pp > 1."
        )
    experts, key = spec.n_experts, "model.n_experts"
    if family.pipeline == "checkpoint":  # cut as its base_model_pp_plan says
        from shardwise.models.hf.auto import read_hf_config
        from shardwise.parallel.expert import routed_experts
        from shardwise.parallel.pipeline_hf import check_hf_pipeline

        check_hf_pipeline(read_hf_config(spec.source).model_type, spec.tie_embeddings, pp)
        experts, key = routed_experts(spec, family)  # (a transformers class: its config counts)
    elif family.pipeline == "none":
        raise ConfigError(
            f"parallel.pp={pp}: pipeline parallelism cuts the blocks of shardwise's own "
            f"decoders and model.name='{cfg.model.name}' is {family.kind}. Fix: --parallel.pp=1."
        )
    if experts and cfg.parallel.pp_schedule == "zb":  # its split backward defers weight
        # gradients; neither the balance loss's backward (models/moe.py) nor the stacked experts
        # of transformers' classes (not linear layers) are checked through it
        raise ConfigError(
            f"parallel.pp_schedule='zb' with routed experts ({key}={experts}) is not built: "
            "the zero-bubble backward split is not checked with routed experts. "
            "Fix: --parallel.pp_schedule=1f1b (or gpipe, interleaved)."
        )


def _check_pipeline_schedule(cfg: Config, pp: int, dp: int, micro: int, m: int) -> None:
    """The ZeRO stage, the schedule and its virtual chunks fit `m` micro-batches per step."""
    p = cfg.parallel
    if p.zero >= 2:
        raise ConfigError(
            f"parallel.zero={p.zero} with parallel.pp={pp} is not supported: ZeRO-{p.zero} "
            "would reduce-scatter every unit's gradients on every micro-batch of the "
            "schedule. Fix: --parallel.zero=1 (optimizer state sharded over dp)."
        )
    interleaved = p.pp_schedule == "interleaved"
    if interleaved != (p.pp_virtual > 1):
        raise ConfigError(
            f"parallel.pp_schedule='{p.pp_schedule}' with parallel.pp_virtual={p.pp_virtual}: "
            "virtual chunks (pp_virtual >= 2) go with the interleaved schedule only. Fix: "
            "--parallel.pp_schedule=interleaved --parallel.pp_virtual=2, or pp_virtual=1."
        )
    if interleaved and m % pp:
        fewer = " is fewer than the stages and" if m < pp else ""
        g = cfg.train.global_batch
        fits = [b for b in range(g // dp, 0, -1) if (g // dp) % b == 0 and (g // dp // b) % pp == 0]
        fix = f"--train.micro_batch={fits[0]}" if fits else f"--train.global_batch={dp * pp}"
        raise ConfigError(
            f"parallel.pp_schedule='interleaved' runs micro-batches in groups of pp({pp}), but "
            f"m = global_batch({g}) / (micro_batch({micro}) * dp({dp})) = {m}{fewer} is not a "
            f"multiple of pp. Fix: {fix}."
        )


def check_tensor_parallel(spec: ModelSpec, family: Family, cfg: Config) -> None:
    """Every size that tensor (and sequence) parallelism splits, against t. The vocabulary
    is padded instead (parallel/tensor.py), so it needs no check."""
    tp, sp = cfg.parallel.tp, cfg.parallel.sp
    if tp <= 1:  # (tp < 1 is reported by topology.degrees with the other degrees)
        return
    name = f"({cfg.model.name})"
    if spec.n_heads % tp:
        raise ConfigError(
            f"model.n_heads={spec.n_heads} {name} is not divisible by parallel.tp={tp}. "
            "Fix: choose tp dividing the number of heads."
        )
    kv = spec.n_kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(
            f"model.n_kv_heads={kv} {name} and parallel.tp={tp}: tp must divide the kv heads "
            f"(split) or be a multiple of them (replicated). Fix: change parallel.tp or "
            "model.n_kv_heads."
        )
    if kv < tp and not family.grouped_query:
        raise ConfigError(
            f"{family.name} has no grouped-query attention: n_kv_heads={kv} < tp={tp}."
        )
    if spec.ffn_dim % tp:
        raise ConfigError(
            f"model.ffn_dim={spec.ffn_dim} {name} is not divisible by parallel.tp={tp}. "
            "Fix: choose tp dividing the MLP width, or --model.ffn_dim=<a multiple of tp>."
        )
    if sp and cfg.data.seq_len % tp:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is not divisible by parallel.tp={tp}: sequence "
            f"parallelism splits the sequence over the tp ranks. Fix: a multiple of {tp}."
        )
    from shardwise.parallel.expert import routed_experts

    experts, key = routed_experts(spec, family)
    what = f"an MoE decoder ({key}={experts})"
    if family.from_checkpoint and family.expert_parallel:  # a transformers MoE class
        what = f"a Hugging Face MoE checkpoint ({key}={experts})"
    if experts and not sp:  # the experts are whole on every tp rank (parallel/expert.py)
        raise ConfigError(
            f"parallel.tp={tp} with {what} needs "
            "parallel.sp=true: tensor parallelism leaves the experts whole, so without sequence "
            "parallelism every tp rank would compute every token's experts. Fix: "
            "--parallel.sp=true, or --parallel.tp=1."
        )
    if sp and family.sp_model_types:  # transformers' classes: the forward takes whole positions
        _check_checkpoint_sp(spec, family, cfg)
    elif sp and not family.sequence_parallel:
        raise ConfigError(
            f"parallel.sp=true is not available for {cfg.model.name}: Hugging Face models build "
            "positions and masks from the local sequence length. Fix: --parallel.sp=false."
        )


def _check_checkpoint_sp(spec: ModelSpec, family: Family, cfg: Config) -> None:
    """tp + sp of a transformers class: the model types checked against one process (over
    pipeline stages those of parallel/pipeline_hf.py's SP_PIPELINE_TYPES), not on packed rows
    (parallel/tensor.py hands the forward plain positions)."""
    pp = cfg.parallel.pp
    model_type = family.sp_model_types[0]  # a preset's family builds the one class it names
    if family.from_checkpoint:
        from shardwise.models.hf.auto import read_hf_config

        model_type = read_hf_config(spec.source).model_type
        if model_type not in family.sp_model_types:
            raise ConfigError(
                f"parallel.sp=true is not available for a '{model_type}' checkpoint: sequence "
                f"parallelism runs transformers' {', '.join(family.sp_model_types)} classes. "
                "Fix: --parallel.tp=1, or --parallel.sp=false (a dense class's tp alone)."
            )
    if cfg.parallel.cp > 1:  # two pre-hooks would each hand the forward its positions
        raise ConfigError(
            f"parallel.sp=true with parallel.cp={cfg.parallel.cp} is not built for Hugging Face "
            "models: context parallelism numbers each rank's zig-zag tokens, sequence "
            "parallelism the whole sequence. Fix: --parallel.sp=false (cp x tp), or "
            "--parallel.cp=1."
        )
    if pp > 1:
        _check_pipeline_sp(model_type, pp)
    if cfg.data.pack:  # packed rows carry their positions within records, the hook does not
        raise ConfigError(
            "data.pack=true with parallel.sp=true is not built for a Hugging Face model: "
            "sequence parallelism hands its forward plain positions 0..s-1, not each "
            "record's. Fix: --data.pack=false, or --parallel.tp=1."
        )


def _check_pipeline_sp(model_type: str, pp: int) -> None:
    """tp + sp over pipeline stages: the model types whose stages were checked against one
    process (each stage's layers number the whole sequence, parallel/pipeline_hf.py)."""
    from shardwise.parallel.pipeline_hf import SP_PIPELINE_TYPES

    if model_type not in SP_PIPELINE_TYPES:
        raise ConfigError(
            f"parallel.sp=true with parallel.pp={pp} is not built for a '{model_type}' model: "
            "tp + sp over pipeline stages is checked against one process for transformers' "
            f"{', '.join(SP_PIPELINE_TYPES)} classes. Fix: --parallel.pp=1 (tp + sp), or "
            "--parallel.tp=1 (pp)."
        )


def check_context_parallel(cfg: Config, spec: ModelSpec, family: Family, tp: int, pp: int) -> None:
    """parallel.cp > 1: what context parallelism runs (parallel/context.py, docs/
    parallelism.md); each refusal names the value and the fix."""
    p, cp, s = cfg.parallel, cfg.parallel.cp, cfg.data.seq_len
    if cp < 1:
        raise ConfigError(f"parallel.cp={cp} must be >= 1. Fix: --parallel.cp=1 (off).")
    if cp == 1:
        if p.cp_mode != "ring":
            raise ConfigError(
                f"parallel.cp_mode={p.cp_mode!r} has no effect with parallel.cp=1. Fix: "
                "--parallel.cp=2 (or more), or leave parallel.cp_mode at its default."
            )
        return
    ft = cfg.finetune
    dropout = {"model.dropout": spec.dropout, "model.attn_dropout": spec.attn_dropout}
    if ft.lora_rank:
        dropout["finetune.lora_dropout"] = ft.lora_dropout
    dropping = {k: v for k, v in dropout.items() if v > 0}
    why = ""
    if not family.context_parallel:
        why = (
            f"model.name='{cfg.model.name}' is {family.kind}, for which context parallelism "
            "is not built (the dense shardwise decoders and gpt2 presets, the hf-llama presets "
            "and Llama, Mistral, Qwen2 and Qwen3 checkpoints have it). Fix: --parallel.cp=1, "
            "or one of those models."
        )
    elif layout := _cp_layout_refusal(cfg, spec, family, tp, pp):
        why = layout
    elif dropping:
        named = ", ".join(f"{k}={v}" for k, v in dropping.items())
        why = (
            f"{named}: dropout masks are drawn per contiguous sequence shard, not for the "
            "zig-zag positions a cp rank holds. Fix: set them to 0, or --parallel.cp=1."
        )
    elif cfg.train.loss != "cross_entropy":
        why = (
            f"train.loss='{cfg.train.loss}' sees whole outputs, and a cp rank holds 1/{cp} of "
            "each sequence. Fix: --train.loss=cross_entropy, or --parallel.cp=1."
        )
    elif family.cp_model_types:  # a checkpoint's class: its model_type decides
        from shardwise.models.hf.auto import read_hf_config
        from shardwise.parallel.context_hf import hf_cp_refusal

        why = hf_cp_refusal(read_hf_config(spec.source), family.cp_model_types, s)
    if why:
        raise ConfigError(
            f"parallel.cp={cp} splits each sample's sequence over {cp} ranks, but {why}"
        )


def _cp_layout_refusal(cfg: Config, spec: ModelSpec, family: Family, tp: int, pp: int) -> str:
    """Why cp cannot split the sequence in this layout ("" when it can): the zig-zag chunks,
    sequence parallelism's further split, Ulysses' heads per rank, and a family whose cp is
    checked against one process without tp and pp only (`Family.cp_composes`)."""
    p, cp, s = cfg.parallel, cfg.parallel.cp, cfg.data.seq_len
    heads = spec.n_heads // tp
    if (tp > 1 or pp > 1) and not family.cp_composes:
        return (
            f"parallel.tp={tp} and parallel.pp={pp}: cp for model.name='{cfg.model.name}' "
            f"({family.kind}) is checked with data parallelism and ZeRO only; the built-in "
            "decoders and transformers' Llama, Mistral, Qwen2 and Qwen3 compose cp with tp and "
            "pp. Fix: --parallel.tp=1 --parallel.pp=1."
        )
    if s % (2 * cp):
        return (
            f"data.seq_len={s} is not divisible by 2 * cp = {2 * cp}: each rank holds two of "
            f"2 * cp equal chunks (the zig-zag split that balances causal attention's work). "
            f"Fix: a data.seq_len that is a multiple of {2 * cp}."
        )
    if p.sp and tp > 1 and (s // cp) % tp:
        return (
            f"parallel.sp=true splits each cp rank's data.seq_len / cp = {s // cp} tokens over "
            f"parallel.tp={tp} ranks, and {s // cp} is not divisible by {tp}. Fix: a "
            f"data.seq_len that is a multiple of {cp * tp * 2 // gcd(2, tp)}, or "
            "--parallel.sp=false."
        )
    if p.cp_mode == "ulysses" and heads % cp:
        per_tp = f" / tp({tp}) = {heads}" if tp > 1 else ""
        return (
            f"parallel.cp_mode=ulysses gives each rank n_heads / (tp * cp) heads, and "
            f"model.n_heads={spec.n_heads}{per_tp} is not divisible by {cp} (k/v heads are "
            "repeated to n_heads before attention, so only n_heads counts). Fix: a cp "
            "dividing that, or --parallel.cp_mode=ring."
        )
    return ""
