"""The parallel transformations of one rank's model, in the one order that works
(docs/architecture.md, "The order in `parallelize()`"): pipeline split, fp8, tensor, context and
expert parallelism, compilation, recomputation, then ZeRO or materialisation and data-parallel
gradient buckets. `training/runtime.py` builds the run around it."""

from __future__ import annotations

import sys

import torch
from torch import nn

from shardwise.config import Config
from shardwise.distributed import device as dev
from shardwise.distributed.comm import Comm
from shardwise.models import init_weights, to_empty
from shardwise.models.hf.auto import HFWeights, weights_for
from shardwise.models.hf.weights import load_weights
from shardwise.models.tp_plans import TPPlan, plan_for
from shardwise.optim import EIGHT_BIT, QUANT_BLOCK
from shardwise.parallel.compile import apply_compile
from shardwise.parallel.compress import WIRE, make_compression
from shardwise.parallel.context import apply_context_parallel
from shardwise.parallel.data import GradReducer, apply_data_parallel
from shardwise.parallel.expert import apply_expert_parallel, apply_sequence_shards
from shardwise.parallel.fp8 import apply_fp8, fp8_emulated, fp8_summary
from shardwise.parallel.pipeline import Pipeline, apply_pipeline
from shardwise.parallel.recompute import apply_recompute
from shardwise.parallel.sync_batchnorm import apply_sync_batchnorm
from shardwise.parallel.tensor import TensorParallel, apply_tensor_parallel, keep_tp_marks
from shardwise.parallel.zero import ZeroEngine, apply_zero
from shardwise.parallel.zero_units import Sharding
from shardwise.training.checks import compile_refusal
from shardwise.training.validate import Derived


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
        compiled, refused = (
            run_cfg.train.compile != "false",
            compile_refusal(run_cfg, derived.family),
        )
        emulated = fp8_emulated(info, "")
        line = fp8_summary(run_cfg.precision.fp8, fp8, emulated, compiled, refused)
        print(line, file=sys.stderr)


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
