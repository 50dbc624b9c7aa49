"""From a validated config to a ready-to-train run on this rank: process group, topology,
model (built on meta, then transformed and materialised by training/parallelize.py), data and
optimizer. The config was validated and derived before the rank started (the job layer):
nothing here checks it again."""

from __future__ import annotations

import fnmatch
import os
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
from shardwise.models.hf.auto import weights_for
from shardwise.optim import MixedPrecisionAdamW, Target, replicated_targets
from shardwise.parallel.context import sequence_part
from shardwise.parallel.data import GradReducer
from shardwise.parallel.expert import ExpertParallel, expert_parallel_of
from shardwise.parallel.pipeline import Pipeline
from shardwise.parallel.tensor import TensorParallel
from shardwise.parallel.zero import ZeroEngine
from shardwise.training.memory import ActivationMeter
from shardwise.training.moe import ExpertTally, expert_tally
from shardwise.training.parallelize import parallelize
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
