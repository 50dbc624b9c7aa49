"""From a validated config to a ready-to-train run on this rank: process group, topology,
model (built on meta, transformed, then materialised), data and optimizer. The config was
validated and derived before the rank started (the job layer): nothing here checks it again."""

from __future__ import annotations

import fnmatch
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import Config
from shardwise.data import GlobalSampler, data_spec, load_data, load_held_out
from shardwise.data.callables import resolve
from shardwise.distributed import device as dev
from shardwise.distributed.comm import Comm
from shardwise.distributed.join import join_process_group, joining_world
from shardwise.distributed.topology import Topology, build_topology
from shardwise.distributed.watchdog import Watchdog, start_watchdog
from shardwise.errors import ConfigError
from shardwise.finetune import build_adapted
from shardwise.finetune.quant import materialise_quantised
from shardwise.finetune.quant_shards import split_dims
from shardwise.models import init_weights, to_empty
from shardwise.models.hf.auto import HFWeights, weights_for
from shardwise.models.hf.weights import load_weights
from shardwise.models.tp_plans import TPPlan, plan_for
from shardwise.optim import (
    EIGHT_BIT,
    QUANT_BLOCK,
    MixedPrecisionAdamW,
    Target,
    replicated_targets,
)
from shardwise.parallel.compile import apply_compile
from shardwise.parallel.compress import WIRE, make_compression
from shardwise.parallel.context import apply_context_parallel, sequence_part
from shardwise.parallel.data import GradReducer, apply_data_parallel
from shardwise.parallel.expert import (
    ExpertParallel,
    apply_expert_parallel,
    apply_sequence_shards,
    expert_parallel_of,
)
from shardwise.parallel.fp8 import apply_fp8, fp8_emulated, fp8_summary
from shardwise.parallel.pipeline import Pipeline, apply_pipeline
from shardwise.parallel.recompute import apply_recompute
from shardwise.parallel.sync_batchnorm import apply_sync_batchnorm
from shardwise.parallel.tensor import TensorParallel, apply_tensor_parallel, keep_tp_marks
from shardwise.parallel.zero import ZeroEngine, apply_zero
from shardwise.parallel.zero_units import Sharding
from shardwise.training.memory import ActivationMeter
from shardwise.training.moe import ExpertTally, expert_tally
from shardwise.training.validate import Derived


def init_distributed(cfg: Config) -> dev.DeviceInfo:
    """Join the job's process group (distributed/join.py) on run.device, its collectives
    bounded by parallel.timeout_s."""
    return join_process_group(cfg.run.device, cfg.parallel.timeout_s)


@dataclass
class Run:
    cfg: Config
    derived: Derived
    info: dev.DeviceInfo
    topo: Topology
    comm: Comm
    model: nn.Module
    reducer: GradReducer | ZeroEngine
    tp: TensorParallel
    optimizer: MixedPrecisionAdamW
    meter: ActivationMeter
    train_data: object
    val_data: object
    sampler: GlobalSampler
    pipeline: Pipeline | None = None  # pp > 1: runs the micro-batches through the stages
    watchdog: Watchdog | None = None
    user_loss: Callable | None = None  # train.loss=module:fn
    resume_note: str | None = None  # what a resume could not restore (checkpoint/state.py)
    experts: ExpertTally | None = None  # MoE models: balance loss, loads, bias (moe.py)
    expert_parallel: ExpertParallel | None = None  # ep > 1: the expert slices (expert.py)

    def close(self, error: BaseException | None = None) -> None:
        """Leave training (finished, or failed with `error`): stop the hang watchdog (this
        rank's silence is no longer a hang; a failure explains its peers' stuck collectives)."""
        if self.watchdog is not None:
            self.watchdog.stop(error)
        if getattr(self, "optimizer", None) is not None:
            self.optimizer.close()
        if hasattr(self.reducer, "close"):
            self.reducer.close()

    @property
    def dp_rank(self) -> int:
        """The sample stream this rank reads: the cp ranks of a run read the same samples."""
        return self.topo.coord("data")

    def loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor, return_logits: bool = False):
        """Summed (not averaged) loss: the caller divides by the *global* count, so any split
        of the global batch over ranks and micro-batches yields the same gradient."""
        if inputs.is_floating_point():  # images enter in the compute dtype
            inputs = inputs.to(dev.dtype_of(self.cfg.precision.compute))
        # context parallelism: this rank's part of every sequence (the count stays global)
        inputs, targets = sequence_part(inputs, self.topo), sequence_part(targets, self.topo)
        chunks = self.cfg.train.loss_chunks
        if chunks > 1 and not return_logits:  # the head and loss by chunks of tokens (checks)
            return self.model(inputs, targets=targets, loss_chunks=chunks)
        logits = self.model(inputs)
        if self.user_loss is not None:  # yours: the micro-batch's sum (validate: tp = pp = 1)
            loss = self.user_loss(logits, targets)
            return (loss, logits) if return_logits else loss
        logits = getattr(logits, "logits", logits)  # a Hugging Face model's output object
        loss = self.tp.loss_sum(logits, targets)  # vocabulary-parallel when the head is split
        return (loss, logits) if return_logits else loss


def freeze(model: nn.Module, patterns: str) -> None:
    """Turn off gradients for parameters matching any pattern; every pattern must match."""
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    for pat in pats:
        hits = [n for n, p in model.named_parameters() if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise ConfigError(
                f"train.freeze pattern '{pat}' matches no parameter. Fix: use "
                "names like 'embed.weight' or 'blocks.0.*'."
            )
        for name, p in model.named_parameters():
            if fnmatch.fnmatchcase(name, pat):
                p.requires_grad_(False)
    if pats and not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"train.freeze='{patterns}' freezes every parameter. Fix: leave "
            "some parameters trainable."
        )


def parallelize(
    model: nn.Module, run_cfg: Config, derived: Derived, comm: Comm, info: dev.DeviceInfo
) -> tuple[nn.Module, GradReducer | ZeroEngine, TensorParallel, Pipeline | None]:
    """Apply the parallel transformations in the one order that works (docs/design.md)."""
    # 1. Pipeline split: the meta model is cut to this rank's chunks (names unchanged), so no
    #    rank ever materialises another stage's layers (pp = 1: the whole model).
    pipeline = apply_pipeline(model, run_cfg, derived, comm) if derived.pp > 1 else None
    # 1b. FP8 swaps the (stage's) block linears for torchao's Float8Linear, same parameters and
    #    names, before tp splits them: tp's sharded forwards then multiply through its casts.
    _apply_fp8(model, run_cfg, derived, comm, info)
    # 2. Tensor parallelism splits the planned layers of the (stage's) meta model in place:
    #    names stay, parameters become local slices that remember where they come from, so
    #    init, ZeRO and checkpoints below see ordinary (smaller) tensors (tp = 1: unchanged).
    tp = apply_tensor_parallel(model, comm, _tp_plan(model, derived), run_cfg.parallel.sp)
    # 3. Context parallelism hands the attention cores this rank's positions of each sequence
    #    and the cp attention kernels; no parameter changes, so recomputation, ZeRO and init
    #    below see the same model, and gradients are summed over dp, which holds the cp ranks.
    apply_context_parallel(model, comm, run_cfg.parallel.cp_mode)
    # 3b. Expert parallelism keeps this rank's E/ep experts of each MoE layer (slices that
    #     remember where they come from, as tp's) and routes rows to the others' by all-to-all;
    #     expert gradients are then reduced over the ranks holding the same experts only.
    apply_expert_parallel(model, comm)
    # 3c. Under tp + sp the MoE layers (left whole by tp) route each rank's sequence shard and
    #     count the other shards' tokens for capacity and the balance loss.
    apply_sequence_shards(model, comm, run_cfg.parallel.sp)
    # 4. Compilation replaces each block's forward by a compiled one (its hooks stay eager);
    #    full recomputation below then wraps the compiled forward and replays compiled code.
    apply_compile(model, derived.family, run_cfg.train.compile)
    # 5. Recomputation wraps module forwards; names stay, so init and checkpoints are unchanged.
    #    BatchNorm forwards take their statistics over every dp replica (layout-invariant).
    apply_recompute(model, derived.family, run_cfg.memory.recompute)
    if run_cfg.model.sync_batchnorm:
        apply_sync_batchnorm(model, comm)
    source = weights_for(derived.spec, run_cfg.model.init_from, model)
    if run_cfg.parallel.zero:
        # 6. ZeRO flattens the still-meta parameters into units and materialises only what
        #    this rank keeps (its slices under ZeRO-3), straight from the (seed, name) init.
        sharding = _sharding(run_cfg, comm, info)
        engine = apply_zero(model, comm, sharding, run_cfg.train.seed, source)
        return model, engine, tp, pipeline
    # 6. Materialise: without ZeRO the local shard is the whole model. Values depend only on
    #    (seed, parameter name), so every rank builds identical weights without a broadcast.
    _materialise(model, run_cfg, info, source)
    # 7. Data parallelism attaches gradient buckets to the materialised parameters.
    return model, _apply_data_parallel(model, run_cfg, comm), tp, pipeline


def _apply_fp8(
    model: nn.Module, run_cfg: Config, derived: Derived, comm: Comm, info: dev.DeviceInfo
) -> None:
    """precision.fp8: swap the family's block linears (parallel/fp8.py); rank 0 says which."""
    fp8 = apply_fp8(model, derived.family, run_cfg.precision.fp8, info)
    if fp8 and comm.topo.rank == 0:
        print(fp8_summary(run_cfg.precision.fp8, fp8, fp8_emulated(info, "")), file=sys.stderr)


def _tp_plan(model: nn.Module, derived: Derived) -> TPPlan | None:
    """The tensor-parallel plan of the model's architecture (None at tp = 1: unchanged)."""
    return plan_for(model, derived.spec.arch) if derived.tp > 1 else None


def _sharding(run_cfg: Config, comm: Comm, info: dev.DeviceInfo) -> Sharding:
    """How ZeRO shards the units: stage, dtypes, device, parameter offload (host memory, or
    files under memory.nvme_dir), the 8-bit optimizers' block and the gradients' wire."""
    offload_params = run_cfg.memory.offload == "optimizer+params"
    if run_cfg.memory.offload == "params+nvme":  # the slices in files under nvme_dir
        from shardwise.optim.nvme import DiskTensors

        where = run_cfg.memory.nvme_dir or run_cfg.run.dir
        offload_params = DiskTensors(where, comm.topo.rank)
    return Sharding(
        run_cfg.parallel.zero,
        dev.dtype_of(run_cfg.precision.compute),
        dev.dtype_of(run_cfg.precision.reduce),
        info.device,
        offload_params,
        QUANT_BLOCK if run_cfg.optim.name in EIGHT_BIT else 1,
        WIRE.get(run_cfg.parallel.grad_compression),
    )


def _materialise(
    model: nn.Module, run_cfg: Config, info: dev.DeviceInfo, source: HFWeights | None
) -> None:
    """The whole model on this rank's device: the checkpoint's values (`source`) or the
    (seed, name) init, then the compute dtype's copies."""
    to_empty(model, info.device)
    if source is not None:
        load_weights(model, source, run_cfg.train.seed)
    else:
        init_weights(model, run_cfg.train.seed)
    cast_for_compute(model, dev.dtype_of(run_cfg.precision.compute))


def _apply_data_parallel(model: nn.Module, run_cfg: Config, comm: Comm) -> GradReducer:
    """Gradient buckets on the materialised parameters, with parallel.grad_compression's wire."""
    par = run_cfg.parallel
    compression = make_compression(
        par.grad_compression, par.powersgd_rank, par.powersgd_warm_start, run_cfg.train.seed
    )
    reduce = dev.dtype_of(run_cfg.precision.reduce)
    return apply_data_parallel(model, comm, reduce, par.bucket_mb, compression)


def cast_for_compute(model: nn.Module, dtype: torch.dtype) -> None:
    """Low-precision compute copies; BatchNorm stays fp32 (its statistics need the range).

    Parameters are replaced module by module (a tied weight once, so it stays tied); this
    also works on fake tensors, which `Module.to` cannot swap."""
    if dtype == torch.float32:
        return
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in cast:
                new = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                cast[id(p)] = keep_tp_marks(p, new)
            module._parameters[name] = cast[id(p)]


def verify_replicas(model: nn.Module, comm: Comm) -> None:
    """Check once that every dp replica holds the same parameters (they are built
    identically; tensor-parallel ranks hold different slices, pipeline stages other layers)."""
    if comm.topo.size("dp") == 1:
        return
    # expert slices (parallel/expert.py) are replicas over the ranks holding the same experts
    dim = [getattr(p, "reduce_dim", "dp") for p in model.parameters()]
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    hi, lo = sums.clone(), sums.clone()
    for d in dict.fromkeys(dim):
        mask = torch.tensor([x == d for x in dim])
        part_hi, part_lo = hi[mask].clone(), lo[mask].clone()
        comm.all_reduce(part_hi, d, "max", control=True)
        comm.all_reduce(part_lo, d, "min", control=True)
        hi[mask], lo[mask] = part_hi, part_lo
    bad = [n for (n, _), a, b in zip(model.named_parameters(), hi, lo, strict=True) if a != b]
    if bad:
        raise RuntimeError(f"parameters differ across ranks after init: {bad[:5]}")


def build_run(cfg: Config, derived: Derived) -> Run:
    """Everything one rank needs for `fit()`, from `cfg` and the run description the job layer
    validated and derived from it (`job.prepare`, `job.prepare.job_here`, which also holds
    the run-dir lock: nothing here takes one)."""
    world = joining_world()
    if derived.world != world:  # a description made for another layout: refused unjoined
        raise ConfigError(
            f"this rank joins a world of {world} ranks, but its job was validated for "
            f"{derived.world}. Fix: start as many ranks as the job was prepared for (--nproc, "
            "--nnodes x ranks per node)."
        )
    info = init_distributed(cfg)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    dev.pin_cpu_cores(cfg.run.cpu_affinity, int(os.environ.get("LOCAL_RANK", "0")), local_world)
    if info.type == "cpu":
        dev.set_cpu_threads()
        dev.keep_freed_memory()
    p = cfg.parallel
    topo = build_topology(p.tp, p.pp, info.type, p.timeout_s, p.cp, p.ep)
    comm = Comm(topo)
    watchdog = start_watchdog(comm, cfg.parallel.timeout_s, cfg.run.dir)
    try:
        return _build(cfg, derived, info, topo, comm, watchdog)
    except BaseException as exc:
        if watchdog is not None:
            watchdog.stop(exc)
        raise


def _build(
    cfg: Config,
    derived: Derived,
    info: dev.DeviceInfo,
    topo: Topology,
    comm: Comm,
    watchdog: Watchdog | None,
) -> Run:
    """The run on this rank once its process group, topology and watchdog stand: data, the
    model built and parallelised, its weights, and the optimizer."""
    spec = derived.spec
    train_data, val_data, sampler = _data(cfg, derived)
    custom_loss = cfg.train.loss != "cross_entropy"  # the loss the run is scored with
    user_loss = resolve(cfg.train.loss, "train.loss") if custom_loss else None
    model, quantised = build_adapted(spec, cfg.finetune)  # LoRA, QLoRA's base (finetune/)
    freeze(model, cfg.train.freeze)
    model, reducer, tp, pipeline = parallelize(model, cfg, derived, comm, info)
    ep = expert_parallel_of(model, comm)
    if quantised:  # every rank quantises the values an unquantised run would start from
        source = weights_for(spec, cfg.model.init_from, model)
        # 1/dp each under ZeRO-3, and 1/tp each (dp outer: finetune/quant_shards.split_index)
        split = split_dims(topo.size("dp"), topo.size("tp"), cfg.parallel.zero)
        materialise_quantised(model, source, cfg.train.seed, info.device, comm, split)
    targets, sum_over_shards, after = _norm_targets(model, comm, reducer, tp, ep, pipeline)
    offload = cfg.memory.offload in ("optimizer", "optimizer+params")
    nvme = None
    if cfg.memory.offload in ("optimizer+nvme", "params+nvme"):
        nvme = (cfg.memory.nvme_dir or cfg.run.dir, topo.rank)
    optimizer = MixedPrecisionAdamW(
        targets, cfg, sum_over_shards, after, offload, tp.reduce_partial, nvme
    )
    return Run(
        cfg,
        derived,
        info,
        topo,
        comm,
        model,
        reducer,
        tp,
        optimizer,
        ActivationMeter(model),
        train_data,
        val_data,
        sampler,
        pipeline=pipeline,
        watchdog=watchdog,
        user_loss=user_loss,
        experts=expert_tally(model, cfg.train, topo.size("pp")),
        expert_parallel=ep,
    )


def _data(cfg: Config, derived: Derived) -> tuple[object, object, GlobalSampler]:
    """What the run reads and in which order (data/): (train data, held-out data, sampler)."""
    spec, labelled = derived.spec, derived.family.classifier
    train_data = load_data(data_spec(cfg, spec.vocab_size, labelled), "train")
    val_data = load_held_out(cfg, spec.vocab_size, labelled)
    sampler = GlobalSampler(len(train_data), cfg.train.global_batch, cfg.train.seed)
    return train_data, val_data, sampler


def _norm_targets(
    model: nn.Module,
    comm: Comm,
    reducer: GradReducer | ZeroEngine,
    tp: TensorParallel,
    ep: ExpertParallel | None,
    pipeline: Pipeline | None,
) -> tuple[list[Target], Callable[[torch.Tensor], None], Callable[[], None] | None]:
    """(tensors the optimizer steps and the gradient norm reads, how the norm's parts are
    summed over the ranks holding other shards, what runs after each step)."""
    if isinstance(reducer, ZeroEngine):
        targets, after = reducer.targets(), reducer.after_step

        def sum_over_shards(parts: torch.Tensor) -> None:
            reducer.sum_over_shards(parts)  # disjoint slices over dp
            tp.sum_over_shards(parts)

    else:
        verify_replicas(model, comm)
        targets, sum_over_shards, after = replicated_targets(model), tp.sum_over_shards, None
        if ep is not None:  # replicated dense parameters, expert slices that differ over ep
            targets = ep.mark_norm_targets(targets)  # (tp > 1: each tensor counted once)

            def sum_over_shards(parts: torch.Tensor) -> None:
                ep.sum_over_shards(parts)
                tp.sum_over_shards(parts)

    if pipeline is not None:  # the norm sums over stages, a tied weight counted once
        targets = pipeline.mark_norm_targets(targets)
        sum_over_shards = pipeline.norm_reducer(sum_over_shards)
    return targets, sum_over_shards, after
