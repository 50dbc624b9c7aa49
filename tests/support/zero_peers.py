"""ZeRO peers: PyTorch FSDP2 (`fully_shard`) and DeepSpeed ZeRO-1/2/3, trained on exactly our
model, data order, AdamW groups, lr schedule, loss normalisation and clipping, as oracles for
`parallel/zero.py` and as the engines it is benchmarked against.

Same contract as `support.peers.ddp_peer`: a function of the config that runs inside
a `run_world` world and returns `losses` (global mean per step), `params` (full-shape fp32 CPU
tensors by our parameter names, gathered on every rank) and `step_times`; plus
`step_cpu_times` (process CPU time per step), `state_bytes` (model states this rank holds, by
our categories, counted from the peer's own tensors) and `comm_bytes` (ring-equivalent bytes
this rank sent per step, counted at `torch.distributed` by `testing.collectives`); the loop,
model and data they share with ours are in `testing.peer_loop`.
`train.freeze` is honoured; tensor/pipeline parallelism, offload and recompute are refused.

DeepSpeed is optional (the `bench` extra). It runs under `DS_ACCELERATOR=cpu` on the gloo
group the harness made, with our torch AdamW as its client optimizer, so none of its C++
optimizer ops is built; its CPU communication backend still JIT-compiles a shared-memory op
(unused by training) on first initialisation: 2.5-4 min on 2 busy cores, once per
`TORCH_EXTENSIONS_DIR`, which defaults here to `$SHARDWISE_CACHE/torch_extensions`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.config import Config
from shardwise.distributed import device as dev
from shardwise.training.validate import Derived
from support.collectives import count_collectives, patch_deepspeed_backend
from support.livepeak import LivePeak
from support.peer_loop import (
    loss_sum,
    optimizer_state_bytes,
    peer_adamw,
    result,
    setup,
    storage_bytes,
    to_local,
    train_loop,
)


# -- FSDP2 ------------------------------------------------------------------------------------
def _blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of repeated containers (transformer blocks, ResNet stages' blocks)."""
    out: list[nn.Module] = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList) or (
            name.startswith("layer") and isinstance(child, nn.Sequential)
        ):
            out += list(child)
    return out


def _unit_sizes(model: nn.Module) -> list[int]:
    """Elements of each of our ZeRO units: each block, each other top-level child."""
    blocks = _blocks(model)
    inside = {id(p) for b in blocks for p in b.parameters()}
    rest = [c for c in model.children() if not any(id(p) in inside for p in c.parameters())]
    return [sum(p.numel() for p in m.parameters()) for m in [*blocks, *rest]]


def fsdp2_peer(cfg: Config) -> dict:
    """Train `cfg` with torch FSDP2 (`fully_shard` on each block, then the root): ZeRO-3's peer.

    fp32, or with `precision.compute` bf16/fp16 a `MixedPrecisionPolicy` computing in it and
    reducing in `precision.reduce` over fp32 sharded parameters (which are the masters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with count_collectives() as counter:
        s = setup(cfg)
        low = cfg.precision.compute != "fp32"
        policy = MixedPrecisionPolicy(
            param_dtype=dev.dtype_of(cfg.precision.compute) if low else None,
            reduce_dtype=dev.dtype_of(cfg.precision.reduce) if low else None,
        )
        mesh = init_device_mesh(s.info.type, (dist.get_world_size(),))
        for module in [*_blocks(s.model), s.model]:
            fully_shard(module, mesh=mesh, mp_policy=policy)
        model = s.model
        params = list(model.parameters())
        opt = peer_adamw(cfg, params)
        state: dict[str, int] = {}

        def micro_step(x, y, i, n):
            model.set_requires_gradient_sync(i == n - 1)  # accumulate unsharded until the last
            loss = loss_sum(model, x, y) / s.rank_count  # FSDP2 averages over ranks, as DDP
            loss.backward()
            return loss.detach()

        def optimizer_step():
            if cfg.optim.grad_clip > 0:
                # Our recipe: the norm of the local shards accumulated in fp64, summed over
                # ranks (Shard(0) pieces are disjoint), then torch's own scaling.
                local = [to_local(p.grad) for p in params if p.grad is not None]
                norm_sq = torch.stack(torch._foreach_norm(local, 2.0, dtype=torch.float64))
                norm_sq = norm_sq.square().sum()
                dist.all_reduce(norm_sq)
                torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.grad_clip, norm_sq.sqrt())
            opt.step()
            if not state:  # after the first step every state exists
                state.update(
                    params=storage_bytes(params),
                    grads=storage_bytes(p.grad for p in params),
                    master=0,  # the fp32 sharded parameters are the masters
                    optimizer=optimizer_state_bytes(opt),
                )
            opt.zero_grad(set_to_none=True)

        losses, *timing = train_loop(s, opt, micro_step, optimizer_step, counter)
        full = {n: _full(p) for n, p in model.named_parameters()}
    return result(losses, timing, full, state, counter, cfg.train.steps)


def _full(p: torch.Tensor) -> torch.Tensor:
    t = p.full_tensor() if hasattr(p, "full_tensor") else p
    return t.detach().float().cpu().clone()


# -- DeepSpeed --------------------------------------------------------------------------------
# why a DeepSpeed comparison is skipped, and the fix
DEEPSPEED_INSTALL = (
    "DeepSpeed is the optional 'bench' extra: pip install -c constraints.txt -e '.[bench]'"
)


def deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (found without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):  # blocked (sys.modules entry None) or broken
        return False


def deepspeed_env() -> None:
    """CPU accelerator, and one cached build folder for its JIT-compiled ops."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cache = os.environ.get("SHARDWISE_CACHE", os.path.expanduser("~/.cache/shardwise"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(cache, "torch_extensions"))


def deepspeed_config(cfg: Config, d: Derived, model: nn.Module, strict: bool = True) -> dict:
    """DeepSpeed's config for our run: its defaults, except what must match ours.

    `strict` makes ZeRO-3 the algorithm ours and FSDP2 run: every parameter sharded (by
    default those under 1e5 elements stay whole on every rank), freed after its forward and
    gathered again for its backward, with about one unit prefetched. By default a gathered
    parameter is kept whenever it is reused within 1e9 elements, and 5e7 elements are
    prefetched, i.e. all of a small model stays gathered from its forward to its backward:
    ZeRO-2's traffic and peak parameter memory."""
    zero: dict = {"stage": cfg.parallel.zero}
    if cfg.parallel.zero == 3 and strict:
        zero.update(
            stage3_param_persistence_threshold=0,
            stage3_max_reuse_distance=0,
            stage3_prefetch_bucket_size=max(_unit_sizes(model)),
        )
    return {
        "train_batch_size": cfg.train.global_batch,
        "train_micro_batch_size_per_gpu": d.micro_batch,
        "gradient_accumulation_steps": d.micro_batches,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW as the client optimizer
        "bf16": {"enabled": cfg.precision.compute == "bf16"},
        "fp16": {"enabled": cfg.precision.compute == "fp16"},
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }


def deepspeed_peer(cfg: Config) -> dict:
    """Train `cfg` with DeepSpeed ZeRO stage `parallel.zero` (1-3); ZeRO-3 as ours runs it."""
    return _deepspeed_peer(cfg, strict=True)


def deepspeed_default_peer(cfg: Config) -> dict:
    """`deepspeed_peer` with DeepSpeed's own ZeRO-3 defaults (see `deepspeed_config`)."""
    return _deepspeed_peer(cfg, strict=False)


def _deepspeed_peer(cfg: Config, strict: bool) -> dict:
    """Train `cfg` with DeepSpeed ZeRO stage `parallel.zero` (1-3).

    Clipping is DeepSpeed's own (`gradient_clipping`): its 0.19 norm accumulates each tensor's
    norm in fp64 like ours but sums their squares in fp32, and scales by 1/((norm+1e-6)/clip)
    instead of clip/(norm+1e-6): a uniform relative difference of ~1e-7 in the gradients."""
    deepspeed_env()
    t0 = time.perf_counter()
    import deepspeed

    import_s = time.perf_counter() - t0
    if cfg.parallel.zero not in (1, 2, 3):
        raise ValueError(f"deepspeed_peer needs parallel.zero in 1..3, got {cfg.parallel.zero}")
    linear = F.linear  # ZeRO-3 replaces it process-wide ("persists unless manually reset")
    with count_collectives() as counter, _restoring(F, "linear", linear):
        s = setup(cfg)
        client = peer_adamw(cfg, list(s.model.parameters()))
        t0 = time.perf_counter()
        engine, _, _, _ = deepspeed.initialize(
            model=s.model,
            optimizer=client,
            config=deepspeed_config(cfg, s.d, s.model, strict),
            dist_init_required=False,
        )
        init_s = time.perf_counter() - t0
        patch_deepspeed_backend()
        state: dict[str, int] = {}
        last = cfg.train.steps - 1

        def micro_step(x, y, i, n):
            # DeepSpeed divides by gradient_accumulation_steps and averages over ranks itself
            loss = loss_sum(engine, x, y) / (s.rank_count // n)
            engine.backward(loss)
            if i == n - 1 and engine.global_steps == last:
                state.update(_deepspeed_grad_bytes(engine))  # gradients exist now
                with LivePeak() as meter:  # what its optimizer step allocates (our AdamW
                    engine.step()  # is fused: nothing of its own)
                state["step_alloc"] = meter.peak
                return loss.detach() / n
            engine.step()  # after every backward: it counts micro-batches, steps on the last
            return loss.detach() / n

        losses, *timing = train_loop(s, client, micro_step, lambda: None, counter)
        state.update(_deepspeed_state_bytes(engine, client))
        full = _deepspeed_full_params(engine, cfg.parallel.zero)
    out = result(losses, timing, full, state, counter, cfg.train.steps)
    out.update(import_s=import_s, init_s=init_s)
    return out


@contextlib.contextmanager
def _restoring(owner: object, attr: str, value: object) -> Iterator[None]:
    try:
        yield
    finally:
        setattr(owner, attr, value)


def _deepspeed_grad_bytes(engine) -> dict[str, int]:
    """Gradients held after the last backward: the model's `.grad`s and the reduced partitions
    (ZeRO-1/2 `averaged_gradients`: {group: [tensor]}; ZeRO-3 one flat buffer)."""
    opt = engine.optimizer
    grads = [p.grad for p in engine.module.parameters()]
    for group in (getattr(opt, "averaged_gradients", None) or {}).values():
        grads += list(group or [])
    grads.append(getattr(opt, "grad_partitions_flat_buffer", None))
    return {"grads": storage_bytes(grads)}


def _deepspeed_state_bytes(engine, client: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters (its flat compute-dtype groups, or their partitions under ZeRO-3), fp32
    partitions (a separate copy even in fp32, counted as master) and optimizer state."""
    opt = engine.optimizer
    params = getattr(opt, "bit16_groups_flat", None) or opt.fp16_partitioned_groups_flat
    masters = getattr(opt, "single_partition_of_fp32_groups", None)
    if masters is None:
        masters = opt.fp32_partitioned_groups_flat
    return {
        "params": storage_bytes(params),
        "master": storage_bytes(masters),
        "optimizer": optimizer_state_bytes(client),
    }


def _deepspeed_full_params(engine, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed

    module = engine.module
    gathered = (
        deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        if stage == 3
        else contextlib.nullcontext()
    )
    with gathered:
        return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}
