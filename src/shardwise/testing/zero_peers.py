"""ZeRO peers: PyTorch FSDP2 (`fully_shard`) and DeepSpeed ZeRO-1/2/3, trained on exactly our
model, data order, AdamW groups, lr schedule, loss normalisation and clipping, as oracles for
`parallel/zero.py` and as the engines it is benchmarked against.

Same contract as `shardwise.testing.peers.ddp_peer`: a function of the config that runs inside
a `run_world` world and returns `losses` (global mean per step), `params` (full-shape fp32 CPU
tensors by our parameter names, gathered on every rank) and `step_times`; plus
`step_cpu_times` (process CPU time per step), `state_bytes` (model states this rank holds, by
our categories, counted from the peer's own tensors) and `comm_bytes` (ring-equivalent bytes
this rank sent per step, counted at `torch.distributed`, see `count_collectives`).
`train.freeze` is honoured; tensor/pipeline parallelism, offload and recompute are refused.

DeepSpeed is optional (the `bench` extra). It runs under `DS_ACCELERATOR=cpu` on the gloo
group the harness made, with our torch AdamW as its client optimizer, so none of its C++
optimizer ops is built; its CPU communication backend still JIT-compiles a shared-memory op
(unused by training) on first initialisation: 2.5-4 min on 2 busy cores, once per
`TORCH_EXTENSIONS_DIR`, which defaults here to `$SHARDWISE_CACHE/torch_extensions`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise import device as dev
from shardwise.config import Config
from shardwise.data import GlobalSampler, load_data, split_for_rank
from shardwise.models import build_model, init_weights
from shardwise.optim import adamw, lr_at
from shardwise.runtime import data_spec, freeze, init_distributed
from shardwise.validate import Derived, derive

# -- byte counting at torch.distributed --------------------------------------------------------
# name -> (argument holding the full-size tensor(s), ring factor as a function of n), the
# conventions of DESIGN.md: all-reduce 2(n-1)/n·S, reduce-scatter/all-gather (n-1)/n·S of the
# full tensor, broadcast (n-1)/n·S.
_COLLECTIVES: dict[str, tuple[str, Callable[[int], float]]] = {
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
    "all_reduce_coalesced": ("tensors", lambda n: 2 * (n - 1) / n),
    "reduce_scatter_single": ("input", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("input", lambda n: (n - 1) / n),
    "_reduce_scatter_base": ("input", lambda n: (n - 1) / n),
    "reduce_scatter": ("input_list", lambda n: (n - 1) / n),
    "all_gather_single": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("output_tensor", lambda n: (n - 1) / n),
    "_all_gather_base": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather": ("tensor_list", lambda n: (n - 1) / n),
    "broadcast": ("tensor", lambda n: (n - 1) / n),
}


@dataclass
class CollectiveCounter:
    """Ring-equivalent bytes sent by this rank while `active`, by collective name. Tensors of
    one element (loss, norm and overflow scalars) are control traffic, counted apart."""

    active: bool = False
    bytes: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    control_bytes: float = 0.0
    _depth: int = 0  # a deprecated alias calls its successor: count the outer call only

    @property
    def total(self) -> float:
        return sum(self.bytes.values())


def _counting(name: str, fn: Callable, counter: CollectiveCounter) -> Callable:
    arg, factor = _COLLECTIVES[name]
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if counter.active and counter._depth == 0:
            bound = signature.bind_partial(*args, **kwargs).arguments
            tensors = bound.get(arg)
            tensors = [tensors] if torch.is_tensor(tensors) else list(tensors or [])
            numel = sum(t.numel() for t in tensors)
            sent = factor(dist.get_world_size(bound.get("group"))) * sum(
                t.numel() * t.element_size() for t in tensors
            )
            if numel <= 1:
                counter.control_bytes += sent
            else:
                counter.bytes[name] = counter.bytes.get(name, 0.0) + sent
                counter.calls[name] = counter.calls.get(name, 0) + 1
        counter._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counter._depth -= 1

    wrapper.__wrapped_collective__ = fn
    return wrapper


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Wrap torch.distributed's collectives (and the ones DeepSpeed's backend captured when
    it initialised) with byte counters; everything is restored on exit. The wrappers cost a
    signature bind per call while counting, microseconds against steps of 10-100 ms."""
    from torch.distributed import distributed_c10d as c10d

    counter = CollectiveCounter()
    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, attr: str, name: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is not None and not hasattr(fn, "__wrapped_collective__"):
            saved.append((owner, attr, fn))
            setattr(owner, attr, _counting(name, fn, counter))

    for name in _COLLECTIVES:
        patch(dist, name, name)
        patch(c10d, name, name)
    try:
        yield counter
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)
        _restore_deepspeed_backend()


def _patch_deepspeed_backend() -> None:
    """DeepSpeed's torch backend keeps the flat gather/scatter functions it found at start-up:
    point them at the (counting) module functions."""
    backend = _deepspeed_backend()
    if backend is not None:
        backend.all_gather_function = dist.all_gather_into_tensor
        backend.reduce_scatter_function = dist.reduce_scatter_tensor


def _restore_deepspeed_backend() -> None:
    backend = _deepspeed_backend()
    if backend is None:
        return
    for attr in ("all_gather_function", "reduce_scatter_function"):
        fn = getattr(backend, attr, None)
        if hasattr(fn, "__wrapped_collective__"):
            setattr(backend, attr, fn.__wrapped_collective__)


def _deepspeed_backend():
    comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(comm, "cdb", None) if comm is not None else None


# -- what every peer shares with ours ---------------------------------------------------------
@dataclass
class _Setup:
    cfg: Config
    d: Derived
    info: dev.DeviceInfo
    model: nn.Module
    data: object
    sampler: GlobalSampler
    rank_count: int  # tokens in this rank's part of the global batch: the loss normaliser


def _setup(cfg: Config) -> _Setup:
    """Model, data and sampler exactly as `ddp_peer` builds them (and `train.freeze`)."""
    unsupported = {
        "parallel.tp": (cfg.parallel.tp, 1),
        "parallel.pp": (cfg.parallel.pp, 1),
        "memory.offload": (cfg.memory.offload, "none"),
        "memory.recompute": (cfg.memory.recompute, "none"),
    }
    bad = {k: v for k, (v, plain) in unsupported.items() if v != plain}
    if bad:
        raise ValueError(f"the ZeRO peers run plain data-parallel ZeRO; unsupported: {bad}")
    info = init_distributed(cfg)
    d = derive(cfg, dist.get_world_size())
    data = load_data(data_spec(cfg, d.spec.vocab_size), "train")
    with torch.device(info.device):
        model = build_model(d.spec)
    init_weights(model, cfg.train.seed)  # (seed, name): every rank holds the same full model
    freeze(model, cfg.train.freeze)
    sampler = GlobalSampler(len(data), cfg.train.global_batch, cfg.train.seed)
    rank_count = cfg.train.global_batch // d.dp * d.tokens_per_sample
    return _Setup(cfg, d, info, model, data, sampler, rank_count)


def _adamw(cfg: Config, params: list[nn.Parameter]) -> torch.optim.AdamW:
    """Our AdamW: weight decay only on matrices (ndim >= 2), foreach implementation."""
    params = [p for p in params if p.requires_grad]
    return adamw([p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2], cfg)


def _loss_sum(model: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="sum")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and aliases count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = _local(t).untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return _storage_bytes(
        v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)
    )


def _train(
    s: _Setup,
    opt: torch.optim.Optimizer,
    micro_step: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor],
    optimizer_step: Callable[[], None],
    counter: CollectiveCounter,
) -> tuple[list[float], list[float], list[float]]:
    """The loop of `ddp_peer`: lr, micro-batches, step. `micro_step(x, y, i, n)` returns the
    detached rank-normalised loss of micro-batch i of n; collectives count inside the step.
    Returns the losses, the wall-clock and the process CPU time of every step."""
    losses, times, cpu = [], [], []
    for step in range(s.cfg.train.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s.cfg)
        t0, c0 = time.perf_counter(), time.process_time()
        micro = split_for_rank(
            s.sampler.global_indices(step), dist.get_rank(), s.d.dp, s.d.micro_batch
        )
        total = torch.zeros(())
        counter.active = True
        for i, idx in enumerate(micro):
            x, y = (t.to(s.info.device) for t in s.data.get_batch(idx))
            total += micro_step(x, y, i, len(micro)).cpu()
        optimizer_step()
        counter.active = False
        dev.synchronize(s.info)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        dist.all_reduce(total)
        losses.append(float(total) / s.d.dp)
    return losses, times, cpu


def _result(losses, timing, params, state, counter: CollectiveCounter, steps: int) -> dict:
    times, cpu = timing
    return {
        "losses": losses,
        "params": params,
        "step_times": times,
        "step_cpu_times": cpu,  # CPU time of the whole process (gloo threads included)
        "state_bytes": state,
        "comm_bytes": counter.total / steps,
        "comm_by_op": {k: v / steps for k, v in counter.bytes.items()},
        "comm_calls": {k: v / steps for k, v in counter.calls.items()},
    }


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
        s = _setup(cfg)
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
        opt = _adamw(cfg, params)
        state: dict[str, int] = {}

        def micro_step(x, y, i, n):
            model.set_requires_gradient_sync(i == n - 1)  # accumulate unsharded until the last
            loss = _loss_sum(model, x, y) / s.rank_count  # FSDP2 averages over ranks, as DDP
            loss.backward()
            return loss.detach()

        def optimizer_step():
            if cfg.optim.grad_clip > 0:
                # Our recipe: the norm of the local shards accumulated in fp64, summed over
                # ranks (Shard(0) pieces are disjoint), then torch's own scaling.
                local = [_local(p.grad) for p in params if p.grad is not None]
                norm_sq = torch.stack(torch._foreach_norm(local, 2.0, dtype=torch.float64))
                norm_sq = norm_sq.square().sum()
                dist.all_reduce(norm_sq)
                torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.grad_clip, norm_sq.sqrt())
            opt.step()
            if not state:  # after the first step every state exists
                state.update(
                    params=_storage_bytes(params),
                    grads=_storage_bytes(p.grad for p in params),
                    master=0,  # the fp32 sharded parameters are the masters
                    optimizer=_optimizer_state_bytes(opt),
                )
            opt.zero_grad(set_to_none=True)

        losses, *timing = _train(s, opt, micro_step, optimizer_step, counter)
        full = {n: _full(p) for n, p in model.named_parameters()}
    return _result(losses, timing, full, state, counter, cfg.train.steps)


def _full(p: torch.Tensor) -> torch.Tensor:
    t = p.full_tensor() if hasattr(p, "full_tensor") else p
    return t.detach().float().cpu().clone()


# -- DeepSpeed --------------------------------------------------------------------------------
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
        s = _setup(cfg)
        client = _adamw(cfg, list(s.model.parameters()))
        t0 = time.perf_counter()
        engine, _, _, _ = deepspeed.initialize(
            model=s.model,
            optimizer=client,
            config=deepspeed_config(cfg, s.d, s.model, strict),
            dist_init_required=False,
        )
        init_s = time.perf_counter() - t0
        _patch_deepspeed_backend()
        state: dict[str, int] = {}
        last = cfg.train.steps - 1

        def micro_step(x, y, i, n):
            # DeepSpeed divides by gradient_accumulation_steps and averages over ranks itself
            loss = _loss_sum(engine, x, y) / (s.rank_count // n)
            engine.backward(loss)
            if i == n - 1 and engine.global_steps == last:
                state.update(_deepspeed_grad_bytes(engine))  # gradients exist now
            engine.step()  # after every backward: it counts micro-batches, steps on the last
            return loss.detach() / n

        losses, *timing = _train(s, client, micro_step, lambda: None, counter)
        state.update(_deepspeed_state_bytes(engine, client))
        full = _deepspeed_full_params(engine, cfg.parallel.zero)
    out = _result(losses, timing, full, state, counter, cfg.train.steps)
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
    return {"grads": _storage_bytes(grads)}


def _deepspeed_state_bytes(engine, client: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters (its flat compute-dtype groups, or their partitions under ZeRO-3), fp32
    partitions (a separate copy even in fp32, counted as master) and optimizer state."""
    opt = engine.optimizer
    params = getattr(opt, "bit16_groups_flat", None) or opt.fp16_partitioned_groups_flat
    masters = getattr(opt, "single_partition_of_fp32_groups", None)
    if masters is None:
        masters = opt.fp32_partitioned_groups_flat
    return {
        "params": _storage_bytes(params),
        "master": _storage_bytes(masters),
        "optimizer": _optimizer_state_bytes(client),
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
